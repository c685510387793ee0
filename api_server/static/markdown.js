// A small Markdown renderer for untrusted model output. It never parses HTML: every piece of
// the text becomes a DOM text node, and the only elements made are the fixed ones below. Links
// keep only http(s) and mailto targets (a javascript: or data: link stays plain text); images
// are shown as their text (a picture from output could track the reader).
"use strict";
(function () {
  const SAFE_URL = /^(https?:|mailto:)/i;

  function el(tag, children) {
    const node = document.createElement(tag);
    for (const child of children || []) node.append(child);
    return node;
  }

  // Inline spans: `code`, **strong**, *em* / _em_, [text](url). Anything else is text.
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([\s\S]+?)\*\*|\*([^*\s][^*]*?)\*|\b_([^_]+?)_\b|(!?)\[([^\]]*)\]\(([^)\s]*)\)/;

  function inline(text) {
    const out = [];
    while (text) {
      const m = INLINE.exec(text);
      if (!m) { out.push(document.createTextNode(text)); break; }
      if (m.index) out.push(document.createTextNode(text.slice(0, m.index)));
      if (m[1]) out.push(el("code", [document.createTextNode(m[2])]));
      else if (m[3] !== undefined) out.push(el("strong", inline(m[3])));
      else if (m[4] !== undefined) out.push(el("em", inline(m[4])));
      else if (m[5] !== undefined) out.push(el("em", inline(m[5])));
      else {
        const url = m[8];
        if (!m[6] && SAFE_URL.test(url)) {
          const a = el("a", inline(m[7]));
          a.href = url;  // (an attribute set from a checked string, never markup)
          a.rel = "noopener noreferrer nofollow";
          a.target = "_blank";
          out.push(a);
        } else {
          out.push(document.createTextNode(m[0]));
        }
      }
      text = text.slice(m.index + m[0].length);
    }
    return out;
  }

  function paragraph(lines) {
    const nodes = [];
    lines.forEach((line, i) => {
      if (i) nodes.push(el("br"));
      nodes.push(...inline(line));
    });
    return el("p", nodes);
  }

  // Blocks: fenced code, headings, block quotes, lists, paragraphs.
  function blocks(text) {
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = /^\s*(```|~~~)/.exec(line);
      if (fence) {
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
        i++;  // the closing fence (or the end of a still-streaming block)
        out.push(el("pre", [el("code", [document.createTextNode(body.join("\n"))])]));
        continue;
      }
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      if (heading) {
        out.push(el("h" + Math.min(heading[1].length + 2, 6), inline(heading[2])));
        i++;
        continue;
      }
      if (/^\s*>/.test(line)) {
        const quoted = [];
        while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*> ?/, ""));
        out.push(el("blockquote", blocks(quoted.join("\n"))));
        continue;
      }
      const item = /^\s*([-*+]|\d+[.)])\s+/;
      if (item.test(line)) {
        const ordered = /\d/.test(item.exec(line)[1]);
        const list = el(ordered ? "ol" : "ul");
        while (i < lines.length && item.test(lines[i])) {
          list.append(el("li", inline(lines[i].replace(item, ""))));
          i++;
        }
        out.push(list);
        continue;
      }
      if (!line.trim()) { i++; continue; }
      const para = [];
      while (i < lines.length && lines[i].trim() && !/^\s*(```|~~~|#{1,6}\s|>)/.test(lines[i])
             && !item.test(lines[i])) para.push(lines[i++]);
      out.push(paragraph(para));
    }
    return out;
  }

  function render(text) {
    const fragment = document.createDocumentFragment();
    fragment.append(...blocks(String(text)));
    return fragment;
  }

  window.LoomMarkdown = { render };
})();
