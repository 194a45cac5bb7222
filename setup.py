"""Package discovery only (metadata lives in pyproject.toml).

The converter recipes live in ``tools/`` (the architecture brief's layout) and install as the
``ninfer_tools`` package, so a plain ``pip install .`` provides ``ninfer convert``.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["ninfer", "ninfer.*"])
    + ["ninfer_tools"]
    + [f"ninfer_tools.{p}" for p in find_packages("tools")],
    package_dir={"ninfer_tools": "tools"},
)
