"""Hand-written Pallas kernels, each beside its pure-jnp reference (see README.md).

A regular package (not a namespace one), so that `import kernels` finds this folder before any
installed distribution of the same name.
"""
