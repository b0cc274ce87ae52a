"""sparkq.formats: the single contract between the converter and the runtime.

Every tensor name, dtype, shape and byte layout of an artifact is defined here
(constants.py, spec.py, layout.py, tensorfile.py, artifact.py) and nowhere else.
"""
from . import constants
from .artifact import Artifact, ArtifactError, quantization_config
from .layout import LAYOUTS, LayoutError, host_layout
from .spec import ModelSpec, Recipe, SpecError, recipe_for_config

__all__ = ["constants", "Artifact", "ArtifactError", "quantization_config", "LAYOUTS", "LayoutError",
           "host_layout", "ModelSpec", "Recipe", "SpecError", "recipe_for_config"]
