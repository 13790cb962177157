"""Maps the user-facing top-level folders onto one import namespace.

``coordinator/`` is imported as ``resilient.coordinator``, ``kernels/`` as
``resilient.kernels`` and ``chaos/`` as ``resilient.chaos`` (docs/design.md §1): ``chaos`` and
``kernels`` are names of unrelated PyPI packages, so nothing is installed top-level but
``resilient``.
"""
from setuptools import find_packages, setup

MAPPED = {"coordinator": "resilient.coordinator", "kernels": "resilient.kernels", "chaos": "resilient.chaos"}

packages = find_packages(include=["resilient", "resilient.*"])
package_dir = {"resilient": "resilient"}
for folder, name in MAPPED.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
