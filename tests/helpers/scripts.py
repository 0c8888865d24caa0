"""Finding a package's command-line script (``chroma``, ``transformers``) for a test.

pip installs a package's scripts beside the interpreter (``.venv/bin``), which is not on
``PATH`` unless the virtual environment is activated, so the README's test command
(``.venv/bin/python -m pytest``) would miss them with a plain ``shutil.which``.
"""

import os
import shutil
import sys
from pathlib import Path


def console_script(name: str) -> str | None:
    """The path of script ``name``: beside this interpreter first, then on ``PATH``."""
    here = str(Path(sys.executable).parent)
    return shutil.which(name, path=os.pathsep.join([here, os.environ.get("PATH", "")]))
