"""Recipes: how a user describes their training job to ckptaudit (the protocol, :mod:`~ckptaudit.recipes.protocol`),
the built-in one (``ckptaudit.recipes.tinygpt:recipe``) and a rank's RNG state (:mod:`~ckptaudit.recipes.rng`).

A user's recipe imports its names from here: ``from ckptaudit.recipes import Job`` (they were in
``ckptaudit.recipe``, which is gone; CHANGELOG.md lists every moved name).
"""

from __future__ import annotations

from ckptaudit.recipes.protocol import (
    DataSource,
    Job,
    Recipe,
    RecipeError,
    UserFailure,
    checked_setup,
    checked_step,
    describe_function,
    eval_forward,
    load_object,
    load_recipe,
    model_forward,
    to_device,
    user_failure,
)

__all__ = ["DataSource", "Job", "Recipe", "RecipeError", "UserFailure", "checked_setup", "checked_step",
           "describe_function", "eval_forward", "load_object", "load_recipe", "model_forward", "to_device",
           "user_failure"]
