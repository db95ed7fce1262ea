"""Sphinx configuration of the static book: ``python tools/build_book.py`` (README, "Read it as a
website"). MyST-NB renders the notebooks' *stored* outputs and never executes a cell; MathJax is
served from the book itself (sphinx-mathjax-offline) and widgets show their static text form, so no
page loads anything from the network."""
project = "ddp-lesson"
author = "ddp-lesson contributors"
extensions = ["myst_nb", "sphinx-mathjax-offline"]   # the package's own (hyphenated) name
root_doc = "book/index"
include_patterns = ["book/index.md", "README.md", "CONTRIBUTING.md", "notebooks/*.ipynb", "notebooks/deep/*.ipynb",
                    "docs/*.md"]
exclude_patterns = ["**/.ipynb_checkpoints", "build", ".venv", "runs"]
nb_execution_mode = "off"                  # the stored outputs, as nbval replays them
nb_ipywidgets_js = {}                      # no require.js or widget manager from a CDN
# a widget's view needs a kernel: show its text/plain form, the one the notebooks store for this
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None),
                              ("html", "application/vnd.jupyter.widget-state+json", None)]
myst_enable_extensions = ["dollarmath", "amsmath", "html_image"]
myst_heading_anchors = 3
smartquotes = False                        # titles keep the apostrophes their anchors have
suppress_warnings = ["myst.header", "misc.highlighting_failure"]
html_theme = "alabaster"
html_title = "ddp-lesson: data-parallel training with PyTorch"
html_theme_options = {"font_family": "sans-serif", "head_font_family": "sans-serif",
                      "page_width": "1100px"}
html_copy_source = False                   # no copy of each notebook's JSON beside its page
html_show_sourcelink = False
html_sidebars = {"**": ["navigation.html", "searchbox.html"]}


from docutils.transforms import Transform  # noqa: E402


class _JupyterLabAnchors(Transform):
    """Give each heading the anchor JupyterLab gives it (its text, spaces as '-': the links the
    notebooks and docs write, ``00_setup.ipynb#3-·-What-torchrun-tells-each-process``) and make
    the raw ``<a id="ranks"></a>`` anchors of the notebooks and docs/pitfalls.md known to MyST's
    link resolver. A transform just before MyST's own ``ResolveAnchorIds`` (priority 879), so a
    link within the same page (``[…](#ranks)``) finds them too, not only a link from another page
    (which reads the same slugs from the environment later)."""

    default_priority = 878

    def apply(self, **kwargs):
        import re

        from docutils import nodes
        env = self.document.settings.env
        slugs = env.metadata[env.docname].setdefault("myst_slugs", {})
        self.document.myst_slugs = slugs
        for section in self.document.findall(nodes.section):
            title = section[0].astext().strip()
            anchor = title.replace(" ", "-")
            if anchor not in section["ids"]:
                section["ids"].append(anchor)
            slugs.setdefault(anchor, (0, anchor, title))
        for raw in self.document.findall(nodes.raw):
            for anchor in re.findall(r'<a (?:id|name)="([^"]+)"', raw.astext()):
                slugs.setdefault(anchor, (0, anchor, anchor))


def setup(app):
    app.add_transform(_JupyterLabAnchors)
