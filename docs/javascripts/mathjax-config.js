// MathJax 3 for pymdownx.arithmatex (generic: true): typeset only the .arithmatex spans and blocks that
// arithmatex writes for $...$ and $$...$$. MathJax itself is vendored beside this file (javascripts/mathjax/tex-svg.js
// and its LICENSE, from the npm package mathjax@3.2.2, Apache-2.0), so the site renders its maths offline: no CDN is
// contacted. The SVG output embeds its glyphs (the CHTML output would fetch web fonts, and headless Chromium's
// screenshots showed its maths blank).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// mkdocs-material's document$ fires on every page load (also with instant navigation): typeset the new page
document$.subscribe(() => {
  if (window.MathJax && MathJax.typesetPromise) {
    MathJax.startup.output.clearCache();
    MathJax.typesetClear();
    MathJax.texReset();
    MathJax.typesetPromise();
  }
});
