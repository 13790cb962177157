"""Maps the user-facing top-level folders onto one import namespace.

``coordinator/`` is imported as ``resilient.coordinator``, ``kernels/`` as
``resilient.kernels`` and ``chaos/`` as ``resilient.chaos`` (docs/design.md §1): ``chaos`` and
``kernels`` are names of unrelated PyPI packages, so nothing is installed top-level but
``resilient``.

Two C extensions are *optional*: where no C compiler is installed, setuptools warns and
installs the rest. ``resilient.kernels._stream_copy`` (``kernels/stream_copy.c``: a memory
copy with streaming stores; without it ``resilient.kernels.copy`` copies with torch) and
``resilient.kernels._qcodec`` (``kernels/qcodec.c``: the compressed allreduce's codec in one
pass per stage; without it ``resilient.collectives.quantization`` runs its torch code, the
same bits and the same wire bytes). ``-ffp-contract=off``: no multiply-add is fused, so the
C codec's float arithmetic is the torch code's, operation for operation.
"""
from setuptools import Extension, find_packages, setup

MAPPED = {"coordinator": "resilient.coordinator", "kernels": "resilient.kernels", "chaos": "resilient.chaos"}

packages = find_packages(include=["resilient", "resilient.*"])
package_dir = {"resilient": "resilient"}
for folder, name in MAPPED.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

stream_copy = Extension("resilient.kernels._stream_copy", ["kernels/stream_copy.c"],
                        extra_compile_args=["-O2"], optional=True)

qcodec = Extension("resilient.kernels._qcodec", ["kernels/qcodec.c"],
                   extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"], optional=True)

setup(packages=packages, package_dir=package_dir, ext_modules=[stream_copy, qcodec])
