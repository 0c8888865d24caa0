"""The bundled task families (see :mod:`envs.workspace.tasks`)."""

from envs.workspace.families.bugfix import BugfixFamily
from envs.workspace.families.data import DataFamily
from envs.workspace.families.files import FilesFamily
from envs.workspace.families.rename import RenameFamily

FAMILIES = {f.name: f for f in (FilesFamily(), DataFamily(), BugfixFamily(), RenameFamily())}

__all__ = ["FAMILIES", "BugfixFamily", "DataFamily", "FilesFamily", "RenameFamily"]
