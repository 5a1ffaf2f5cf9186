// A small, safe markdown renderer for model answers.
//
// Safety rule: model text never passes through an HTML parser. The renderer builds DOM nodes itself
// (createElement / createTextNode), so every character of the text stays text. The only elements made are
// p, br, h1-h6, hr, strong, em, del, code, pre, blockquote, ul, ol, li, a, table, thead, tbody, tr, th, td;
// the only attributes are a link's href (http, https or mailto only) with fixed rel and target, a code
// block's class (letters, digits, '_', '+', '-'), a list's start (digits) and a table cell's alignment class.
//
// render(source) returns a DocumentFragment; renderMarkdown(source) is its HTML serialisation (for tests).
"use strict";

(function (global) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  function safeHref(url) {
    return /^(https?:\/\/|mailto:)[^\s]+$/i.test(url) ? url : null;
  }

  function el(tag, children) {
    const node = document.createElement(tag);
    if (children) node.append(...children);
    return node;
  }

  // --- inline markup ----------------------------------------------------------------------------
  const CODE_SPAN = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/y;
  const LINK = /\[([^\]\n]+)\]\(([^()\s]+)\)/y;
  const ESCAPABLE = /[\\`*_{}[\]()#+\-.!|~<>]/;
  const WORD = /[\p{L}\p{N}_]/u;
  const SPACE = /\s/;

  const isWord = (c) => c !== undefined && WORD.test(c);
  const isSpace = (c) => c === undefined || SPACE.test(c);

  // Where the delimiter run `delim` opening at `start` closes (the index of the closing run), or -1.
  // Runs of the same character are taken whole; `strict`: underscore-style flanking (no word character
  // right outside either run).
  function closer(text, start, delim, strict) {
    const open = start + delim.length;
    if (isSpace(text[open])) return -1;
    const ch = delim[0];
    let j = open;
    while (j < text.length) {
      const c = text[j];
      if (c === "`") {                  // a code span inside is skipped whole
        CODE_SPAN.lastIndex = j;
        const m = CODE_SPAN.exec(text);
        if (m) {
          j += m[0].length;
          continue;
        }
      }
      if (c === "\\") {
        j += 2;
        continue;
      }
      if (c === ch) {
        let run = 0;
        while (text[j + run] === ch) run += 1;
        const fits = delim.length === 1 ? run === 1 : run >= delim.length;
        if (j > open && fits && !isSpace(text[j - 1])) {
          const end = j + run - delim.length;
          if (!strict || !isWord(text[end + delim.length])) return end;
        }
        j += run;
        continue;
      }
      j += 1;
    }
    return -1;
  }

  const EMPHASIS = {
    "***": (kids) => el("em", [el("strong", kids)]),
    "**": (kids) => el("strong", kids),
    "__": (kids) => el("strong", kids),
    "~~": (kids) => el("del", kids),
    "*": (kids) => el("em", kids),
    "_": (kids) => el("em", kids),
  };

  // The nodes of one line (or table cell) of text.
  function inline(text) {
    const out = [];
    // A search for a closing run that failed from some index fails from any later one too: remembered, so a
    // line of unmatched openers costs linear time, not quadratic.
    const noCloser = {};
    let buf = "";
    const flush = () => {
      if (buf) out.push(document.createTextNode(buf));
      buf = "";
    };
    let i = 0;
    while (i < text.length) {
      const c = text[i];
      if (c === "\\" && ESCAPABLE.test(text[i + 1] || "")) {
        buf += text[i + 1];
        i += 2;
        continue;
      }
      if (c === "`") {
        CODE_SPAN.lastIndex = i;
        const m = CODE_SPAN.exec(text);
        if (m) {
          flush();
          out.push(el("code", [m[2]]));
          i += m[0].length;
        } else {                          // an unmatched run of backticks is text, all of it
          let j = i;
          while (text[j] === "`") j += 1;
          buf += text.slice(i, j);
          i = j;
        }
        continue;
      }
      if (c === "[") {
        LINK.lastIndex = i;
        const m = LINK.exec(text);
        if (m) {
          flush();
          const href = safeHref(m[2]);
          if (href === null) {
            out.push(...inline(m[1]));
          } else {
            const a = el("a", inline(m[1]));
            a.setAttribute("href", href);
            a.setAttribute("rel", "noopener noreferrer nofollow");
            a.setAttribute("target", "_blank");
            out.push(a);
          }
          i += m[0].length;
          continue;
        }
      }
      if (c === "*" || c === "_" || c === "~") {
        let run = 0;
        while (text[i + run] === c) run += 1;
        const delim = c.repeat(Math.min(run, 3));
        const strict = c === "_";
        const wrap = run <= 3 ? EMPHASIS[delim] : undefined;
        // An opener: '_' and a single '*' not right after a word character (snake_case, 2*3*4).
        const opens = wrap && !((strict || delim === "*") && isWord(text[i - 1]));
        let end = -1;
        if (opens && !(i >= noCloser[delim])) {
          end = closer(text, i, delim, strict);
          if (end < 0) noCloser[delim] = i;
        }
        if (end >= 0) {
          flush();
          out.push(wrap(inline(text.slice(i + delim.length, end))));
          i = end + delim.length;
        } else {                          // no emphasis here: the whole run is text
          buf += text.slice(i, i + run);
          i += run;
        }
        continue;
      }
      buf += c;
      i += 1;
    }
    flush();
    return out;
  }

  // --- blocks -----------------------------------------------------------------------------------
  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+-]*)\s*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])(\s+)(.*)$/;
  const ITEM_EMPTY = /^(\s*)([-*+]|\d{1,9}[.)])\s*$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

  const indentOf = (line) => line.match(/^\s*/)[0].replace(/\t/g, "    ").length;
  const blank = (line) => line.trim() === "";

  // A list item's marker: {indent, ordered, number, content (offset of the text), text}.
  function item(line) {
    let m = ITEM.exec(line);
    let text;
    let pad;
    if (m) {
      text = m[4];
      pad = m[3].length > 4 ? 1 : m[3].length;   // a long gap is indented code in CommonMark; keep it simple
    } else if ((m = ITEM_EMPTY.exec(line))) {
      text = "";
      pad = 1;
    } else {
      return null;
    }
    const indent = indentOf(m[1]);
    const ordered = !/^[-*+]$/.test(m[2]);
    return { indent: indent, ordered: ordered, number: ordered ? parseInt(m[2], 10) : 0,
             bullet: ordered ? m[2].slice(-1) : m[2], content: indent + m[2].length + pad, text: text };
  }

  // A table row's cells: split on '|' outside code spans and not escaped; outer pipes dropped.
  function cells(line) {
    let s = line.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    const out = [];
    let cell = "";
    let i = 0;
    while (i < s.length) {
      const c = s[i];
      if (c === "\\" && s[i + 1] === "|") {
        cell += "\\|";
        i += 2;
      } else if (c === "`") {
        CODE_SPAN.lastIndex = i;
        const m = CODE_SPAN.exec(s);
        const piece = m ? m[0] : "`";
        cell += piece;
        i += piece.length;
      } else if (c === "|") {
        out.push(cell.trim());
        cell = "";
        i += 1;
      } else {
        cell += c;
        i += 1;
      }
    }
    out.push(cell.trim());
    return out;
  }

  function isTableStart(lines, i) {
    return i + 1 < lines.length && lines[i].includes("|") && TABLE_RULE.test(lines[i + 1]) &&
      lines[i + 1].includes("-") && (lines[i + 1].includes("|") || lines[i].trim().startsWith("|")) &&
      cells(lines[i]).length === cells(lines[i + 1]).length;
  }

  function startsBlock(lines, i) {
    const line = lines[i];
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      ITEM.test(line) || isTableStart(lines, i);
  }

  function table(lines, i) {
    const head = cells(lines[i]);
    const aligns = cells(lines[i + 1]).map((spec) => {
      const left = spec.startsWith(":");
      const right = spec.endsWith(":");
      return left && right ? "center" : right ? "right" : left ? "left" : "";
    });
    const row = (values, tag) => el("tr", head.map((_, k) => {
      const cell = el(tag, inline(values[k] || ""));
      if (aligns[k]) cell.className = "align-" + aligns[k];
      return cell;
    }));
    const body = [];
    i += 2;
    while (i < lines.length && !blank(lines[i]) && lines[i].includes("|") && !FENCE.test(lines[i])) {
      body.push(row(cells(lines[i]), "td"));
      i += 1;
    }
    const node = el("table", [el("thead", [row(head, "th")])]);
    if (body.length) node.appendChild(el("tbody", body));
    return { node: node, next: i };
  }

  // A list starting at lines[i]; items whose lines are indented past their marker hold nested blocks.
  function list(lines, i, depth) {
    const first = item(lines[i]);
    const node = document.createElement(first.ordered ? "ol" : "ul");
    if (first.ordered && first.number !== 1) node.setAttribute("start", String(first.number));
    while (i < lines.length) {
      const it = item(lines[i]);
      if (!it || it.ordered !== first.ordered || it.bullet !== first.bullet) break;
      const body = [it.text];
      i += 1;
      while (i < lines.length) {
        const line = lines[i];
        if (blank(line)) {                // a blank line stays in the item if the item goes on after it
          let k = i;
          while (k < lines.length && blank(lines[k])) k += 1;
          if (k < lines.length && indentOf(lines[k]) >= it.content) {
            for (; i < k; i += 1) body.push("");
            continue;
          }
          break;
        }
        const indent = indentOf(line);
        if (indent <= it.indent) break;
        body.push(line.replace(/\t/g, "    ").slice(Math.min(indent, it.content)));
        i += 1;
      }
      const li = el("li", blocks(body, depth + 1));
      const paragraphs = li.querySelectorAll(":scope > p");
      if (paragraphs.length === 1 && li.firstChild === paragraphs[0]) {   // a tight item: no paragraph
        paragraphs[0].replaceWith(...paragraphs[0].childNodes);
      }
      node.appendChild(li);
      // Blank lines between items keep the list going.
      let k = i;
      while (k < lines.length && blank(lines[k])) k += 1;
      const next = k < lines.length ? item(lines[k]) : null;
      if (k > i && next && next.ordered === first.ordered && next.bullet === first.bullet) {
        i = k;
      }
    }
    return { node: node, next: i };
  }

  // Block nodes of some lines (with a "\n" text node between blocks).
  function blocks(lines, depth) {
    const out = [];
    const push = (node) => {
      if (out.length) out.push(document.createTextNode("\n"));
      out.push(node);
    };
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        const indent = indentOf(line);
        i += 1;
        while (i < lines.length && lines[i].trim() !== fence) {
          body.push(lines[i].slice(Math.min(indent, indentOf(lines[i]))));
          i += 1;
        }
        i += 1; // the closing fence (absent while an answer is still streaming)
        const code = el("code", [body.join("\n")]);
        if (m[2]) code.className = "lang-" + m[2];
        push(el("pre", [code]));
      } else if ((m = HEADING.exec(line))) {
        push(el("h" + m[1].length, inline(m[2])));
        i += 1;
      } else if (RULE.test(line)) {
        push(el("hr"));
        i += 1;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          body.push(m[1]);
          i += 1;
        }
        push(el("blockquote", depth < 8 ? blocks(body, depth + 1) : [body.join("\n")]));
      } else if (ITEM.test(line) && depth < 16) {
        const result = list(lines, i, depth);
        push(result.node);
        i = result.next;
      } else if (isTableStart(lines, i)) {
        const result = table(lines, i);
        push(result.node);
        i = result.next;
      } else if (blank(line)) {
        i += 1;
      } else {
        const body = [];
        while (i < lines.length && !blank(lines[i]) && (body.length === 0 || !startsBlock(lines, i))) {
          if (body.length) body.push(el("br"));
          body.push(...inline(lines[i].trim()));
          i += 1;
        }
        push(el("p", body));
      }
    }
    return out;
  }

  function render(source) {
    const fragment = document.createDocumentFragment();
    fragment.append(...blocks(String(source).replace(/\r\n?/g, "\n").split("\n"), 0));
    return fragment;
  }

  function renderMarkdown(source) {
    const box = document.createElement("div");
    box.appendChild(render(source));
    return box.innerHTML; // serialisation of nodes built above, for tests and debugging
  }

  global.PocketMarkdown = { escapeHtml: escapeHtml, render: render, renderMarkdown: renderMarkdown };
})(window);
