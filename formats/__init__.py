"""sparkq.formats: the single contract between the converter and the runtime.

Every tensor name, dtype, shape and byte layout of an artifact, and every manifest key, is
defined here (constants.py, spec.py, layout.py, tensorfile.py, manifest.py, artifact.py) and
nowhere else; docs/format.md is the normative summary.
"""
from . import constants
from .artifact import Artifact, ArtifactError
from .layout import LAYOUTS, LayoutError, host_layout
from .manifest import LinearEntry, Manifest, ManifestError
from .recipe import Recipe, SpecError, recipe_for_config
from .spec import ModelSpec

__all__ = ["constants", "Artifact", "ArtifactError", "LinearEntry", "Manifest", "ManifestError", "LAYOUTS",
           "LayoutError", "host_layout", "ModelSpec", "Recipe", "SpecError", "recipe_for_config"]
