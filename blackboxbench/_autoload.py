"""Import every module of a package so that their ``@register`` decorators run (one file per family)."""
import importlib
import pkgutil


def import_submodules(package_name, package_path):
    for info in sorted(pkgutil.iter_modules(package_path), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package_name}.{info.name}")
