// A small markdown renderer for model output that can never run it as HTML or JavaScript: it builds DOM
// nodes and puts every piece of the text in with createTextNode, so "<script>" stays the characters
// "<script>". Links keep only http(s) and mailto URLs. Handles what chat replies use: fenced code
// blocks (an unclosed fence, as while streaming, runs to the end), headings, lists, quotes, rules,
// tables (GitHub's: a header row, a delimiter row giving each column's alignment, body rows), paragraphs with
// line breaks, and inline code, bold, italic, links, bare URLs and backslash escapes (\* is a star).
(function (global) {
  "use strict";

  const SAFE_URL = /^(https?:\/\/|mailto:)/i;
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  // The text after the marker, its closing #s cut in code (headingText): a lazy (.*?) before \s*#*\s*$ tried every
  // split of a run of spaces, and a heading with thousands of them froze the tab for seconds (QA-W).
  const HEADING = /^ {0,3}(#{1,6})\s+(.*)$/;
  const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}>\s?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const BLANK = /^\s*$/;
  const DELIMITER_CELL = /^:?-+:?$/;
  // More columns than this are not taken for a table: short rows are padded to the header's width, so a wide header
  // over many short rows would build millions of cells from a few kilobytes of text.
  const MAX_TABLE_COLUMNS = 64;
  // Quotes and lists nest at most this deep; deeper markers are text (">" x 5000 overflowed the call stack).
  const MAX_NESTING = 16;
  // One alternative per inline construct; group numbers are read in inlineNode().
  const INLINE = new RegExp([
    "`([^`\\n]+)`",                                            // 1 code
    "\\*\\*(?=\\S)([^*]+?)\\*\\*",                              // 2 bold
    "__(?=\\S)([^_]+?)__",                                     // 3 bold
    "\\*(?=[^\\s*])([^*\\n]+?)\\*",                             // 4 italic
    "(?<![\\w_])_(?=[^\\s_])([^_\\n]+?)_(?![\\w_])",            // 5 italic
    // 6 an image's "!", 7, 8 link text, URL (one level of balanced parentheses: Wikipedia's a_(b))
    "(!?)\\[([^\\]\\n]+)\\]\\(\\s*((?:[^()\\s]|\\([^()\\s]*\\))+)\\s*\\)",
    "(https?://[^\\s<>()\"']*[^\\s<>()\"'.,;:!?])",              // 9 bare URL
    "\\\\([!-/:-@\\[-`{-~])",                                   // 10 an escaped punctuation character
  ].join("|"), "g");

  function el(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  // An <a> for a safe URL around `content` (nodes), or null.
  function link(content, url) {
    if (!SAFE_URL.test(url)) return null;
    const a = el("a");
    a.setAttribute("href", url);
    a.setAttribute("rel", "noopener noreferrer nofollow");
    a.setAttribute("target", "_blank");
    a.append(...content);
    return a;
  }

  function inlineNode(m, inLink) {
    if (m[1] !== undefined) { const c = el("code"); c.textContent = m[1]; return c; }
    if (m[2] !== undefined || m[3] !== undefined) {
      const b = el("strong");
      b.append(...inline(m[2] ?? m[3], inLink));
      return b;
    }
    if (m[4] !== undefined || m[5] !== undefined) {
      const i = el("em");
      i.append(...inline(m[4] ?? m[5], inLink));
      return i;
    }
    if (m[7] !== undefined) {
      if (inLink) return document.createTextNode(m[0]);  // no link inside a link's text
      // An image is a link to it named by its alt text: the page loads no images (its CSP allows none).
      const content = m[6] ? [document.createTextNode(`image: ${m[7]}`)] : inline(m[7], true);
      return link(content, m[8]) || document.createTextNode(m[0]);
    }
    if (m[10] !== undefined) return document.createTextNode(m[10]);
    if (inLink) return document.createTextNode(m[9]);
    return link([document.createTextNode(m[9])], m[9]);
  }

  // Inline constructs of one line or paragraph, as a list of nodes (inLink: inside a link's text, whose URLs are
  // text: an <a> inside an <a> is no HTML).
  function inline(text, inLink) {
    const nodes = [];
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) nodes.push(document.createTextNode(text.slice(last, m.index)));
      nodes.push(inlineNode(m, inLink));
      last = m.index + m[0].length;
    }
    if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
    return nodes;
  }

  function codeBlock(lines, start) {
    const open = lines[start].match(FENCE);
    const marker = open[1];
    const close = new RegExp("^ {0,3}" + marker[0].replace(/[`~]/, "\\$&") + "{" + marker.length + ",}\\s*$");
    let end = start + 1;
    while (end < lines.length && !close.test(lines[end])) end++;
    const wrap = el("div", "code-block");
    const head = el("div", "code-head");
    const lang = el("span", "code-lang");
    lang.textContent = open[2] || "code";
    const copy = el("button", "copy");
    copy.type = "button";
    copy.textContent = "Copy";
    const code = el("code");
    code.textContent = lines.slice(start + 1, end).join("\n");
    copy.addEventListener("click", () => {
      if (navigator.clipboard) navigator.clipboard.writeText(code.textContent).catch(() => {});
    });
    head.append(lang, copy);
    const pre = el("pre");
    pre.append(code);
    wrap.append(head, pre);
    return { node: wrap, next: end + 1 };
  }

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
  }

  // A table row's cells: split at pipes that are not escaped (\|), the outer pipes dropped.
  function cells(line) {
    const parts = line.trim().replace(/^\|/, "").replace(/(?<!\\)\|$/, "").split(/(?<!\\)\|/);
    return parts.map((cell) => cell.trim().replace(/\\\|/g, "|"));
  }

  // A header row followed by a delimiter row (cells of dashes, with colons for alignment) with as many columns
  // starts a table. Cells are split and tested one by one: a single regex over the row backtracked quadratically
  // on long runs of spaces.
  function isTable(lines, i) {
    if (i + 1 >= lines.length || !lines[i].includes("|") || !lines[i + 1].includes("-")) return false;
    const delimiter = cells(lines[i + 1]);
    return delimiter.length <= MAX_TABLE_COLUMNS && delimiter.every((cell) => DELIMITER_CELL.test(cell))
      && cells(lines[i]).length === delimiter.length;
  }

  function table(lines, start) {
    const aligns = cells(lines[start + 1]).map((c) =>
      c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
    const row = (line, tag) => {
      const tr = el("tr");
      const values = cells(line);
      aligns.forEach((align, column) => {  // GitHub's: a short row is padded, a long one cut, to the header's
        const cell = el(tag, align ? "align-" + align : null);
        cell.append(...inline(values[column] ?? ""));
        tr.append(cell);
      });
      return tr;
    };
    const node = el("table");
    const head = el("thead");
    head.append(row(lines[start], "th"));
    const body = el("tbody");
    let i = start + 2;
    while (i < lines.length && !BLANK.test(lines[i]) && lines[i].includes("|") && !isBlockStart(lines[i])) {
      body.append(row(lines[i], "td"));
      i++;
    }
    node.append(head, body);
    const wrap = el("div", "table-wrap");  // scrolls sideways rather than widening the page
    wrap.append(node);
    return { node: wrap, next: i };
  }

  function list(lines, start, depth) {
    const first = lines[start].match(ITEM);
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.setAttribute("start", String(parseInt(first[2], 10)));
    let i = start;
    while (i < lines.length) {
      const m = lines[i].match(ITEM);
      if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
      const body = [m[3]];
      i++;
      // An item runs on over lines indented deeper than its marker (a nested list, a continued sentence).
      while (i < lines.length && !BLANK.test(lines[i]) && lines[i].match(/^\s*/)[0].length > indent) {
        body.push(lines[i].slice(Math.min(indent + 2, lines[i].match(/^\s*/)[0].length)));
        i++;
      }
      const li = el("li");
      blocks(body, li, depth + 1);
      if (li.childNodes.length === 1 && li.firstChild.tagName === "P") li.replaceChildren(...li.firstChild.childNodes);
      node.append(li);
    }
    return { node, next: i };
  }

  function paragraph(lines, start) {
    const p = el("p");
    let i = start;
    while (i < lines.length && !BLANK.test(lines[i])
           && (i === start || !(isBlockStart(lines[i]) || isTable(lines, i)))) {
      if (i > start) p.append(el("br"));
      p.append(...inline(lines[i]));
      i++;
    }
    return { node: p, next: i };
  }

  // A heading's text without its closing sequence: trailing #s after a space (or alone), then spaces.
  function headingText(text) {
    text = text.trimEnd();
    let end = text.length;
    while (end > 0 && text[end - 1] === "#") end--;
    return end === 0 || text[end - 1] === " " || text[end - 1] === "\t" ? text.slice(0, end).trimEnd() : text;
  }

  function block(lines, i, depth) {
    const line = lines[i];
    if (FENCE.test(line)) return codeBlock(lines, i);
    if (depth >= MAX_NESTING && (QUOTE.test(line) || ITEM.test(line))) return paragraph(lines, i);
    const h = line.match(HEADING);
    if (h) {
      const node = el("h" + h[1].length);
      node.append(...inline(headingText(h[2])));
      return { node, next: i + 1 };
    }
    if (RULE.test(line)) return { node: el("hr"), next: i + 1 };
    if (QUOTE.test(line)) {
      let end = i;
      while (end < lines.length && QUOTE.test(lines[end])) end++;
      const node = el("blockquote");
      blocks(lines.slice(i, end).map((l) => l.replace(QUOTE, "")), node, depth + 1);
      return { node, next: end };
    }
    if (ITEM.test(line)) return list(lines, i, depth);
    if (isTable(lines, i)) return table(lines, i);
    return paragraph(lines, i);
  }

  function blocks(lines, parent, depth) {
    let i = 0;
    while (i < lines.length) {
      if (BLANK.test(lines[i])) { i++; continue; }
      const { node, next } = block(lines, i, depth);
      parent.append(node);
      i = next;
    }
  }

  // Markdown text -> a DocumentFragment of safe nodes; plain text if the renderer fails on some input, so a reply
  // can never break the page.
  function renderMarkdown(text) {
    const source = String(text ?? "");
    const fragment = document.createDocumentFragment();
    try {
      blocks(source.replace(/\r\n?/g, "\n").split("\n"), fragment, 0);
    } catch (error) {
      const p = el("p");
      p.textContent = source;
      fragment.replaceChildren(p);
    }
    return fragment;
  }

  global.PagedServe = Object.assign(global.PagedServe || {}, { renderMarkdown });
})(window);
