"""megatron_rl: asynchronous RL post-training of LLMs on native PyTorch (after Meta's LlamaRL)."""
__version__ = "0.1.0"

# setup.py installs two top-level folders of the repository under this package (its package_dir):
# megatron_rl.kernels = kernels/, megatron_rl.checkpoints_tools = checkpoints_tools/. An installed
# package (wheel or editable) finds them by itself; run from the source tree without an install (the
# repository root on sys.path), the finder below resolves exactly these two names to those folders and
# nothing else of the repository root (tests/, scripts/, examples/ stay invisible as subpackages).
SOURCE_TREE_SUBPACKAGES = ("kernels", "checkpoints_tools")


def _install_source_tree_finder() -> None:
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    locations = {
        f"{__name__}.{name}": os.path.join(root, name)
        for name in SOURCE_TREE_SUBPACKAGES
        # a regular install has the folder inside the package; the source tree has it beside it
        if not os.path.isdir(os.path.join(here, name)) and os.path.isfile(os.path.join(root, name, "__init__.py"))
    }
    if not locations or not os.path.isfile(os.path.join(root, "setup.py")):
        return  # an installed package: nothing to map
    if any(getattr(finder, "locations", None) == locations for finder in sys.meta_path):
        return  # already installed (the package was reloaded)

    class SourceTreeSubpackages:
        """A meta path finder for `megatron_rl.kernels` and `megatron_rl.checkpoints_tools` in the source
        tree. First on sys.meta_path, so that the folders beside *this* megatron_rl are the ones imported
        (an editable install elsewhere maps the names to its own checkout); every other name passes."""

        def __init__(self, locations: dict[str, str]):
            self.locations = locations

        def find_spec(self, fullname, path=None, target=None):
            location = self.locations.get(fullname)
            if location is None:
                return None
            from importlib.util import spec_from_file_location

            return spec_from_file_location(fullname, os.path.join(location, "__init__.py"),
                                           submodule_search_locations=[location])

        def invalidate_caches(self) -> None:
            pass

    sys.meta_path.insert(0, SourceTreeSubpackages(locations))


_install_source_tree_finder()
del _install_source_tree_finder
