"""Package discovery for the root-as-package layout.

pyproject.toml maps the package ``alignzoo`` to the repository root; this file
lists every subpackage under the folders that ship (common, models, weights,
sync, serve) so that a new op folder is picked up without editing a list.
"""
from setuptools import find_packages, setup

SHIPPED = ("common", "models", "weights", "sync", "serve", "parallel")
subpackages = [
    f"alignzoo.{p}" for p in find_packages(where=".", include=[f"{s}*" for s in SHIPPED])
]
setup(packages=["alignzoo", *subpackages])
