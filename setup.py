from setuptools import find_packages, setup

setup(
    name="moe-dispatch",
    version="0.1.0",
    description="Expert-parallel token dispatch and combine for Mixture-of-Experts training in PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[*find_packages(include=["dispatch", "dispatch.*"]), "dispatch.csrc"],
    package_dir={"dispatch.csrc": "csrc"},  # the NVLink engine's kernels, compiled at first use
    package_data={"dispatch.csrc": ["*.cu", "*.cuh", "*.cpp"]},
    install_requires=["torch>=2.4"],
    extras_require={
        "test": ["pytest", "hypothesis", "triton", "matplotlib"],
        "bench": ["matplotlib"],
        "cuda12": ["cupy-cuda12x", "ninja"],
        "cuda13": ["cupy-cuda13x", "ninja"],
        "megatron": ["megatron-core"],
    },
    entry_points={"console_scripts": ["dispatch-bench=dispatch.bench:main"]},
)
