"""Packaging's one computed part (the rest is pyproject.toml): the top-level strategy modules, found by their name,
so a new `<stem>_strategy.py` is installed without a list to edit. They stay at the top level (the design card's
file names) and workers import them by their class paths (parity/registry.py); their helpers live in the `parity`
package (parity/strategies/<stem>/), which pyproject.toml's packages.find takes whole."""

import glob
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

setup(py_modules=sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "*_strategy.py"))))
