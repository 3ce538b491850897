"""Builds the optional C inner loop of the copier (mlcheckpoint/integrity/_hashcopy.c).

Everything else is in pyproject.toml. Without a C compiler the build skips the extension
(optional=True) and mlcheckpoint uses its pure-Python copier: same results, slower saves.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mlcheckpoint.integrity._hashcopy", ["mlcheckpoint/integrity/_hashcopy.c"],
                             optional=True)])
