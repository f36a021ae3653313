"""The Megatron-Bridge recipe a GPU job builds, and its values as the start of the run config the harness validates.

`resolve` starts a GPU target's run config from the project's recipe (the model's dimensions), replaces every
value the Megatron-Bridge recipe sets with that recipe's (`recipe_facts`: from the fixture of the release the
user names with `--bridge_version`, the 0.6.2 wheel's by default, main's with `main`), then
applies the user's overrides and flags, as the job applies them to the recipe it builds. So the pre-launch
validation and the dry run's list of changed settings are about the job that will run, not about the
project's own recipe. Where Megatron-Bridge builds no recipe (a recipe file, a family it has no recipe for,
a GPU or precision without a performance recipe) or its values are not known here, the project's recipe
stays, and a note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mbridge_epoverlap.config.container import RunConfig
from mbridge_epoverlap.config.overrides import apply_recipe_values
from mbridge_epoverlap.errors import UsageError
from mbridge_epoverlap.harness.bridge_recipes import BridgeRecipe, configs_of
from mbridge_epoverlap.harness.hf_configs import HF_MODELS
from mbridge_epoverlap.harness.recipe_facts import (
    facts_for,
    facts_label,
    load_facts,
    not_built,
    recipe_names_for,
)


@dataclass
class UpstreamRecipe:
    """What the job builds.

    Attributes:
        recipe: the Megatron-Bridge recipe, or None when it builds none for these flags.
        facts: its values (`recipe_facts.recipe_values`), or None when they are not known here.
        notes: what the user should know about the choice (printed on stderr).
        skipped: recipe keys whose value the run config cannot hold (kept the project's).
    """

    recipe: BridgeRecipe | None
    facts: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def apply(self, cfg: RunConfig) -> None:
        """Replace the run config's values with the recipe's (nothing without facts)."""
        if self.facts is None:
            return
        self.skipped = apply_recipe_values(cfg, self.facts)
        if self.skipped:
            self.notes.append(f"the run config cannot hold the recipe's {', '.join(self.skipped)}; validated the "
                              "project recipe's values for them")

    @property
    def env_vars(self) -> dict[str, str]:
        """The recipe's launch environment (Megatron-Bridge exports it before the processes start)."""
        return {key: str(value) for key, value in ((self.facts or {}).get("env_vars") or {}).items()}


def upstream_recipe(args: Any, cfg: RunConfig) -> UpstreamRecipe:
    """The recipe the job builds for these flags, with its values where they are known.

    `cfg` is the run config with every override and flag applied (the job chooses the recipe from the final
    GPU count and the flags).
    """
    from mbridge_epoverlap.harness.job_options import bridge_lookup
    from mbridge_epoverlap.harness.mbridge_job import choose_recipe
    from mbridge_epoverlap.recipes.loader import family_of

    family = family_of(cfg.recipe)
    if family is None:
        return UpstreamRecipe(None, None, [f"Megatron-Bridge has no recipe for {cfg.recipe!r}; validated the recipe "
                                           "as written (the GPU job needs a built-in recipe name)"])
    release = getattr(args, "bridge_version", None)
    names = recipe_names_for(release)
    try:
        recipe = choose_recipe(family, cfg.recipe, cfg.task, perf_names=names, **bridge_lookup(args, cfg))
    except (LookupError, UsageError) as exc:
        if not getattr(args, "use_recipes", False) and configs_of(names, cfg.recipe):
            raise UsageError(str(exc)) from None  # Megatron-Bridge has this workload, not this config: as upstream
        return UpstreamRecipe(None, None, [f"the job will stop: {exc}; validated the project's recipe {cfg.recipe}"])
    facts = facts_for(recipe.module, recipe.function, release=release)
    label = facts_label(release)
    broken = not_built(recipe.module, recipe.function, release)
    if facts is None and broken is not None:
        raise UsageError(f"{label} cannot build {recipe.describe()}: its own code raises {broken}; pick another "
                         "-c/-cv, or run the job with a Megatron-Bridge that can (--bridge_version main)")
    if facts is None and recipe.kind == "library" and cfg.recipe in HF_MODELS:
        fixture = load_facts(release=release)
        known = sorted(key.rpartition(".")[2] for key in [*fixture["recipes"], *fixture.get("not_built", {})]
                       if key.startswith(f"megatron.bridge.recipes.{family}.{cfg.recipe}_"))
        raise UsageError(f"{label} has no library recipe {recipe.module}.{recipe.function} (--use_recipes); "
                         f"its library recipes of {cfg.recipe}: {', '.join(known) or 'none'}; leave out --use_recipes "
                         "to build the performance recipe")
    if facts is None:
        return UpstreamRecipe(recipe, None, [f"the values of {recipe.describe()} are not known here (the facts of "
                                             f"{label} lack it); validated the project's recipe "
                                             f"{cfg.recipe} instead (--check_with_bridge checks the job itself)"])
    return UpstreamRecipe(recipe, facts, [f"validating the job {label} builds: {recipe.describe()} "
                                          "with the flags' and overrides' changes"])
