"""The two build steps setup.cfg cannot declare (everything else is there).

1. The recipes: a wheel carries the clone's top-level conf/ as transformer/conf/ (transformer/config.py looks
   there first). conf/ stays where a reader finds and edits it; an editable install reads it in place, so this
   step is skipped for one, and the editable install stays a plain .pth entry (setup.cfg's package_dir).
2. The commit: transformer/_commit.txt holds the commit the build came from, for `transformer-train --version`
   outside a clone. An sdist has no .git, so it carries the commit in a top-level COMMIT file.
"""
import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent


def commit() -> str:
    """The sdist's COMMIT file, else what transformer.commit() reads from this clone's git."""
    recorded = ROOT / "COMMIT"
    if recorded.is_file():
        return recorded.read_text(encoding="utf-8").strip()
    # By path, not `import transformer`: nothing but this dependency-free file is importable at build time.
    spec = importlib.util.spec_from_file_location("transformer_init", ROOT / "transformer" / "__init__.py")
    init = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(init)
    return init.commit(ROOT / "transformer")


class BuildPy(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        package = Path(self.build_lib) / "transformer"
        shutil.rmtree(package / "conf", ignore_errors=True)  # a file removed from conf/ leaves no stale copy
        files = sorted((ROOT / "conf").rglob("*.yaml"))
        if not files:
            raise SystemExit(f"setup.py: no conf/**/*.yaml under {ROOT}: the wheel would have no recipes")
        for src in files:
            dest = package / "conf" / src.relative_to(ROOT / "conf")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
        (package / "_commit.txt").write_text(commit() + "\n", encoding="utf-8")


class Sdist(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        Path(base_dir, "COMMIT").write_text(commit() + "\n", encoding="utf-8")


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
