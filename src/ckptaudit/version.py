"""The version of ckptaudit (``ckptaudit.__version__``), which reports and manifests record. A module of its own
so that the renderers and the writer can name it without importing the package root, which resolves the public
names (and so the whole API) on first use."""

__version__ = "0.1.0"
