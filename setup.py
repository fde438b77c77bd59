"""Package discovery for the two import roots (metadata lives in pyproject.toml).

`core/` is imported as `backplane` and `plugins/` as `backplane.plugins`, so the package names are
found under each folder and prefixed, instead of being listed by hand.
"""

from setuptools import find_packages, setup


def _packages(folder: str, name: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


setup(packages=_packages("core", "backplane") + _packages("plugins", "backplane.plugins"))
