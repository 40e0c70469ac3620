from tests.recipe_cases import SLURM_FILL, recipe  # noqa: F401  (fixture and constant for this folder's tests)
