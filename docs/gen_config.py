"""Writes the configuration reference page: `python docs/gen_config.py > docs/configuration.md`.

The page comes from `gradmesh.config.reference.markdown`, given each key's `gradmesh train` flag
as the CLI's parser declares it (the config layer does not know the CLI). tests/test_docs.py
checks the committed page equals `generate()`.
"""

from gradmesh.cli import build_parser
from gradmesh.cli.options import FLAG_KEYS
from gradmesh.config.reference import markdown


def train_flags() -> dict[str, str]:
    """{"section.key": "--flag"} for every config key `gradmesh train` has a flag for."""
    commands = next(action for action in build_parser()._actions if action.dest == "command")
    flags = {}
    for action in commands.choices["train"]._actions:
        if action.dest in FLAG_KEYS and action.option_strings:
            flags[FLAG_KEYS[action.dest]] = action.option_strings[0]
    return flags


def generate() -> str:
    return markdown(train_flags())


if __name__ == "__main__":
    print(generate(), end="")
