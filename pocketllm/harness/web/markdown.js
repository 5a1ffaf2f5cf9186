// A small, safe markdown renderer for model answers.
//
// Safety rule: the whole input is HTML-escaped first; after that only tags this file writes itself can
// appear in the output (p, br, h1-h6, hr, strong, em, del, code, pre, blockquote, ul, ol, li, a). The only
// attributes written are a link's href (http, https or mailto only, always quoted, built from escaped
// text) and a code block's class (letters, digits, '+', '-' only).
"use strict";

(function (global) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  function safeHref(url) {
    return /^(https?:\/\/|mailto:)[^\s]+$/i.test(url) ? url : null;
  }

  // Emphasis on a piece of already-escaped text that holds no code span and no link.
  function emphasis(text) {
    return text
      .replace(/\*\*(?=\S)([^*]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^_\w])__(?=\S)([^_]*?\S)__(?![_\w])/g, "$1<strong>$2</strong>")
      .replace(/~~(?=\S)([^~]*?\S)~~/g, "<del>$1</del>")
      .replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?![_\w])/g, "$1<em>$2</em>");
  }

  // Inline markup of one escaped line: code spans and links are cut out first, emphasis applies elsewhere.
  function inline(text) {
    const pattern = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\[([^\]\n]+)\]\(([^()\s]+)\)/g;
    let out = "";
    let last = 0;
    let match;
    while ((match = pattern.exec(text)) !== null) {
      out += emphasis(text.slice(last, match.index));
      if (match[1] !== undefined) {
        out += "<code>" + match[2] + "</code>";
      } else {
        const href = safeHref(match[4]);
        out += href === null
          ? emphasis(match[3])
          : '<a href="' + href + '" rel="noopener noreferrer nofollow" target="_blank">' + emphasis(match[3]) + "</a>";
      }
      last = pattern.lastIndex;
    }
    return out + emphasis(text.slice(last));
  }

  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const QUOTE = /^\s*&gt;\s?(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;

  function isSpecial(line) {
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
      BULLET.test(line) || NUMBERED.test(line);
  }

  function renderMarkdown(source) {
    const lines = escapeHtml(source).replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const fence = m[1];
        const body = [];
        i += 1;
        while (i < lines.length && lines[i].trim() !== fence) {
          body.push(lines[i]);
          i += 1;
        }
        i += 1; // the closing fence (absent while an answer is still streaming)
        const cls = m[2] ? ' class="lang-' + m[2] + '"' : "";
        out.push("<pre><code" + cls + ">" + body.join("\n") + "</code></pre>");
      } else if ((m = HEADING.exec(line))) {
        const level = m[1].length;
        out.push("<h" + level + ">" + inline(m[2]) + "</h" + level + ">");
        i += 1;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i += 1;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          body.push(inline(m[1]));
          i += 1;
        }
        out.push("<blockquote>" + body.join("<br>") + "</blockquote>");
      } else if (BULLET.test(line) || NUMBERED.test(line)) {
        const kind = BULLET.test(line) ? BULLET : NUMBERED;
        const tag = kind === BULLET ? "ul" : "ol";
        const items = [];
        while (i < lines.length && (m = kind.exec(lines[i]))) {
          items.push("<li>" + inline(m[1]) + "</li>");
          i += 1;
        }
        out.push("<" + tag + ">" + items.join("") + "</" + tag + ">");
      } else if (line.trim() === "") {
        i += 1;
      } else {
        const body = [];
        while (i < lines.length && lines[i].trim() !== "" && !isSpecial(lines[i])) {
          body.push(inline(lines[i]));
          i += 1;
        }
        out.push("<p>" + body.join("<br>") + "</p>");
      }
    }
    return out.join("\n");
  }

  global.PocketMarkdown = { escapeHtml: escapeHtml, renderMarkdown: renderMarkdown };
})(window);
