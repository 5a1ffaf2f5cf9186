// The PocketLLM web client: conversations kept in localStorage, each on its own host session, all over one
// WebSocket. Model text reaches the page only through PocketMarkdown.render (which builds DOM nodes, the
// text always in text nodes) or textContent; nothing here assigns HTML.
"use strict";

(function () {
  const STORE_KEY = "pocketllm.conversations.v1";
  const TOKEN_KEY = "pocketllm.token";
  const DIAG_KEY = "pocketllm.diagnostics";
  const OPTIONS_KEY = "pocketllm.options";
  const MAX_BACKOFF_MS = 4000;
  const NARROW = window.matchMedia("(max-width: 720px)");
  const MODEL_FILE = /\.(gguf|ggml|safetensors|bin|pt|pth|onnx)$/i;
  const ROLES = ["system", "user", "assistant"];
  const TOMBSTONE_MS = 30 * 24 * 3600 * 1000;   // how long a deletion is remembered, for tabs that still hold it
  const $ = (id) => document.getElementById(id);

  const state = loadState();
  let socket = null;
  let authed = false;
  let refused = false;
  let backoff = 500;
  let reconnectTimer = null;
  let saveTimer = null;
  let nextId = 1;
  const opened = new Set();     // sessions open on the current socket
  const inflight = new Map();   // request id -> {conv, user, message}
  const elements = new WeakMap(); // message -> its element

  // --- state ------------------------------------------------------------------------------------
  // The stored conversations in the shape this client uses, whatever localStorage held (an older client's data,
  // another tab's write, a hand edit): null if it holds no conversation list; else the conversations that are
  // objects with a string id (the first of any two with one id), each with the messages that have a role and a
  // text. What cannot be shown is left out, so one bad entry costs only itself, not the whole client.
  function cleanState(saved) {
    if (!saved || typeof saved !== "object" || !Array.isArray(saved.conversations)) return null;
    const conversations = [];
    const ids = new Set();
    for (const conv of saved.conversations) {
      if (!conv || typeof conv !== "object" || typeof conv.id !== "string" || ids.has(conv.id)) continue;
      ids.add(conv.id);
      conv.messages = (Array.isArray(conv.messages) ? conv.messages : []).filter((m) =>
        m && typeof m === "object" && ROLES.includes(m.role) && typeof m.content === "string");
      if (typeof conv.title !== "string") conv.title = "";
      if (typeof conv.created !== "number") conv.created = 0;
      if (typeof conv.updated !== "number") conv.updated = conv.created;
      conversations.push(conv);
    }
    const deleted = {};   // id -> when it was deleted
    if (saved.deleted && typeof saved.deleted === "object") {
      for (const [id, when] of Object.entries(saved.deleted)) {
        if (typeof when === "number") deleted[id] = when;
      }
    }
    return { conversations: conversations, active: ids.has(saved.active) ? saved.active : null, deleted: deleted };
  }

  // Another tab's conversations merged into ours (both tabs write the one stored list, so neither may simply
  // replace it): for each id the copy changed last, ours while this tab streams into it; a conversation deleted
  // after its last change stays deleted. Newest first, as the list shows them; this tab's open one stays open.
  function merged(theirs) {
    const deleted = Object.assign({}, theirs.deleted);
    for (const [id, when] of Object.entries(state.deleted)) deleted[id] = Math.max(when, deleted[id] || 0);
    const byId = new Map(theirs.conversations.map((c) => [c.id, c]));
    for (const conv of state.conversations) {
      const other = byId.get(conv.id);
      if (!other || busy(conv) || conv.updated >= other.updated) byId.set(conv.id, conv);
    }
    const conversations = [...byId.values()]
      .filter((c) => busy(c) || !(deleted[c.id] >= c.updated))
      .sort((a, b) => b.created - a.created);
    const horizon = Date.now() - TOMBSTONE_MS;
    for (const [id, when] of Object.entries(deleted)) {
      if (when < horizon) delete deleted[id];
    }
    const active = conversations.some((c) => c.id === state.active) ? state.active
      : (conversations.length ? conversations[0].id : null);
    return { conversations: conversations, active: active, deleted: deleted };
  }

  function adopt(next) {
    state.conversations = next.conversations;
    state.active = next.active;
    state.deleted = next.deleted;
  }

  function storedState() {
    try {
      return cleanState(JSON.parse(localStorage.getItem(STORE_KEY)));
    } catch (err) {
      return null;
    }
  }

  // A conversation changed in this tab: it wins over an older copy of it from another tab.
  function touch(conv) {
    conv.updated = Math.max(Date.now(), conv.updated + 1);
  }

  function loadState() {
    const saved = storedState() || { conversations: [], active: null, deleted: {} };
    for (const conv of saved.conversations) {
      for (const m of conv.messages) {
        if (m.streaming) {   // the page went away mid-answer
          m.streaming = false;
          m.finish = m.finish || "interrupted";
        }
      }
    }
    return saved;
  }

  function save() {
    clearTimeout(saveTimer);
    saveTimer = null;
    const stored = storedState();
    if (stored) adopt(merged(stored));   // what another tab wrote since is kept
    localStorage.setItem(STORE_KEY, JSON.stringify(state));
  }

  function saveSoon() {
    if (saveTimer === null) saveTimer = setTimeout(save, 200);
  }

  function newSessionId() {
    const bytes = new Uint8Array(8);
    crypto.getRandomValues(bytes);
    return "w" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  function activeConv() {
    return state.conversations.find((c) => c.id === state.active) || null;
  }

  function newConversation() {
    const now = Date.now();
    const conv = { id: newSessionId(), title: "", messages: [], created: now, updated: now };
    state.conversations.unshift(conv);
    state.active = conv.id;
    save();
    openSession(conv);
    render();
    return conv;
  }

  // What the host should hold for a conversation: finished turns, failed ones left out.
  function history(conv) {
    return conv.messages
      .filter((m) => !m.failed && !m.error && !(m.role === "assistant" && m.streaming))
      .map((m) => ({ role: m.role, content: m.content }));
  }

  function busy(conv) {
    for (const entry of inflight.values()) {
      if (entry.conv === conv) return true;
    }
    return false;
  }

  // --- socket -----------------------------------------------------------------------------------
  function send(obj) {
    if (socket && socket.readyState === WebSocket.OPEN) socket.send(JSON.stringify(obj));
  }

  function connect() {
    clearTimeout(reconnectTimer);
    const token = localStorage.getItem(TOKEN_KEY);
    if (!token) {
      showLogin("");
      return;
    }
    refused = false;
    setStatus("connecting");
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(scheme + location.host + "/");
    socket = ws;
    ws.onopen = () => ws.send(JSON.stringify({ op: "auth", id: "auth", token: token }));
    ws.onmessage = (event) => {
      if (socket !== ws) return;
      let msg;
      try {
        msg = JSON.parse(event.data);
      } catch (err) {
        return;
      }
      onMessage(msg);
    };
    ws.onclose = () => {
      if (socket === ws) onClosed();
    };
  }

  function onClosed() {
    socket = null;
    authed = false;
    opened.clear();
    for (const entry of inflight.values()) {
      entry.message.streaming = false;
      entry.message.finish = "interrupted";
      touch(entry.conv);
    }
    inflight.clear();
    save();
    render();
    if (refused) return;
    setStatus("offline");
    reconnectTimer = setTimeout(connect, backoff);
    backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
  }

  function openSession(conv) {
    if (!authed || opened.has(conv.id)) return;
    const msg = { op: "open", id: "open:" + conv.id, session: conv.id };
    const known = history(conv);
    if (known.length) msg.messages = known;
    opened.add(conv.id);
    send(msg);
  }

  function onMessage(msg) {
    if (msg.id === "auth") {
      if (msg.auth === "ok") {
        authed = true;
        backoff = 500;
        showApp();
        send({ op: "health", id: "health" });
        for (const conv of state.conversations) openSession(conv);
      } else {
        refused = true;
        localStorage.removeItem(TOKEN_KEY);
        showLogin(msg.error || "the host refused the token");
      }
      updateControls();
      return;
    }
    if (msg.id === "health") {
      setStatus(msg.state || "offline");
      showModel(msg);
      if (msg.state === "loading") setTimeout(() => send({ op: "health", id: "health" }), 1000);
      return;
    }
    if (typeof msg.id === "string" && msg.id.startsWith("open:")) {
      if (msg.error) opened.delete(msg.id.slice(5));
      return;
    }
    if (typeof msg.id === "string" && msg.id.startsWith("close:")) return;
    if (msg.id === null || msg.id === undefined) {
      if (msg.session && (msg.expired || msg.detached)) opened.delete(msg.session);
      return;
    }
    const entry = inflight.get(msg.id);
    if (!entry) return;
    const m = entry.message;
    touch(entry.conv);
    if (typeof msg.chunk === "string") {
      m.content += msg.chunk;
      saveSoon();
      updateMessage(m);
    } else if (msg.done) {
      m.streaming = false;
      m.finish = msg.finish;
      m.usage = msg.usage;
      if (msg.diag) m.diag = msg.diag;
      inflight.delete(msg.id);
      save();
      render();
    } else if (msg.error) {
      m.streaming = false;
      m.error = msg.error;
      entry.user.failed = true;
      inflight.delete(msg.id);
      save();
      render();
    }
  }

  // --- actions ----------------------------------------------------------------------------------
  function sendMessage(text) {
    if (!authed || !text.trim()) return;
    const conv = activeConv() || newConversation();
    if (busy(conv)) return;
    openSession(conv);
    const user = { role: "user", content: text };
    const answer = { role: "assistant", content: "", streaming: true };
    conv.messages.push(user, answer);
    if (!conv.title) conv.title = text.slice(0, 48);
    touch(conv);
    const id = nextId++;
    inflight.set(id, { conv: conv, user: user, message: answer });
    const request = { op: "chat", id: id, session: conv.id, messages: [{ role: "user", content: text }] };
    if (diagnosticsOn()) request.diag = true;
    Object.assign(request, samplingOptions());
    send(request);
    save();
    render();
  }

  function stop() {
    const conv = activeConv();
    for (const [id, entry] of inflight) {
      if (entry.conv === conv) send({ op: "cancel", id: id });
    }
  }

  function deleteConversation(conv) {
    if (busy(conv)) return;
    if (authed) send({ op: "close", id: "close:" + conv.id, session: conv.id });
    opened.delete(conv.id);
    state.deleted[conv.id] = Math.max(Date.now(), conv.updated + 1);
    state.conversations = state.conversations.filter((c) => c !== conv);
    if (state.active === conv.id) state.active = state.conversations.length ? state.conversations[0].id : null;
    save();
    render();
  }

  // The composer's optional sampling fields (empty: the host's defaults).
  function samplingOptions() {
    const options = {};
    const n = parseInt($("opt-n").value, 10);
    const temp = parseFloat($("opt-temp").value);
    if (Number.isInteger(n) && n > 0) options.n = n;
    if (Number.isFinite(temp) && temp >= 0) options.temp = temp;
    return options;
  }

  function loadOptions() {
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem(OPTIONS_KEY)) || {};
    } catch (err) {
      saved = {};
    }
    $("opt-n").value = saved.n === undefined ? "" : String(saved.n);
    $("opt-temp").value = saved.temp === undefined ? "" : String(saved.temp);
  }

  function saveOptions() {
    localStorage.setItem(OPTIONS_KEY, JSON.stringify(samplingOptions()));
  }

  function diagnosticsOn() {
    return localStorage.getItem(DIAG_KEY) === "1";
  }

  // --- rendering --------------------------------------------------------------------------------
  function setStatus(text) {
    const el = $("status");
    el.textContent = text;
    el.dataset.state = text;
  }

  function showLogin(error) {
    $("login").hidden = false;
    $("app").hidden = true;
    $("forget-token").hidden = true;
    $("sidebar-toggle").hidden = true;
    $("login-error").textContent = error || "";
    setStatus("offline");
  }

  function showApp() {
    $("login").hidden = true;
    $("app").hidden = false;
    $("forget-token").hidden = false;
    $("sidebar-toggle").hidden = false;
    render();
  }

  // The parts of an answer's status line (each shown unbroken).
  function metaParts(m) {
    if (m.role !== "assistant") return [];
    if (m.streaming) return ["streaming"];
    if (m.finish === "interrupted") return ["interrupted (connection lost)"];
    const parts = [];
    if (m.finish) parts.push("finish: " + m.finish);
    const u = m.usage;
    if (u) {
      parts.push(u.gen_tokens + (u.gen_tokens === 1 ? " token" : " tokens"));
      if (u.prefill_ms > 0) parts.push("first token " + seconds(u.prefill_ms));
      if (u.decode_ms > 0) parts.push("decode " + seconds(u.decode_ms));
      // As `pocketllm run` counts it: the first token comes from the prefill, the rest from the decode.
      if (u.gen_tokens > 1 && u.decode_ms > 0) parts.push(rate((u.gen_tokens - 1) / (u.decode_ms / 1000)));
    }
    return parts;
  }

  function seconds(ms) {
    const s = ms / 1000;
    if (s > 0 && s < 0.01) return "< 0.01 s";
    return (s < 10 ? s.toFixed(2) : s.toFixed(1)) + " s";
  }

  function rate(perSecond) {
    return (perSecond >= 100 ? perSecond.toFixed(0) : perSecond.toFixed(1)) + " tok/s";
  }

  function usageTitle(u) {
    if (!u) return "";
    return "prompt " + u.prompt_tokens + " tokens, " + u.gen_tokens + " generated; prefill (time to first token) " +
      u.prefill_ms + " ms, decode " + u.decode_ms + " ms";
  }

  // What to call the model: the name the host gives, else the last part of its path without the file's
  // extension (a Hugging Face cache path: the repository's name).
  function modelName(msg) {
    for (const key of ["name", "model_name"]) {
      if (typeof msg[key] === "string" && msg[key].trim()) return msg[key].trim();
    }
    const label = typeof msg.model === "string" ? msg.model.trim() : "";
    const parts = label.split(/[\\/]+/).filter((p) => p !== "");
    const cached = parts.find((p) => /^models--/.test(p));
    if (cached) return cached.split("--").pop();
    return (parts.pop() || "").replace(MODEL_FILE, "");
  }

  function showModel(msg) {
    const name = modelName(msg);
    $("model").textContent = name;
    $("model").title = name ? "model: " + name : "";
    document.title = name ? name + " · PocketLLM" : "PocketLLM";
  }

  function fillMessage(el, m) {
    el.className = "message " + m.role + (m.streaming ? " streaming" : "");
    el.dataset.finish = m.finish || "";
    el.replaceChildren();
    const body = document.createElement("div");
    body.className = "body";
    if (m.role === "assistant") {
      body.appendChild(window.PocketMarkdown.render(m.content)); // DOM nodes; the model's text stays text
      addCopyButtons(body);
    } else {
      body.textContent = m.content;
    }
    el.appendChild(body);
    if (m.error) {
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = m.error;
      el.appendChild(error);
    }
    const meta = document.createElement("div");
    meta.className = "meta";
    metaParts(m).forEach((text, k) => {
      const part = document.createElement("span");
      part.className = "part";
      part.textContent = text;
      if (k) meta.append(" · ");
      meta.append(part);
    });
    if (m.usage) meta.title = usageTitle(m.usage);
    el.appendChild(meta);
  }

  // Each code block gets a button that copies its text.
  function addCopyButtons(body) {
    for (const pre of body.querySelectorAll("pre")) {
      const box = document.createElement("div");
      box.className = "codeblock";
      const button = document.createElement("button");
      button.type = "button";
      button.className = "copy";
      button.textContent = "Copy";
      button.title = "Copy this code";
      button.addEventListener("click", () => {
        const text = pre.textContent;
        copyText(text).then((ok) => {
          button.textContent = ok ? "Copied" : "Copy failed";
          setTimeout(() => { button.textContent = "Copy"; }, 1500);
        });
      });
      pre.replaceWith(box);
      box.append(button, pre);
    }
  }

  function copyText(text) {
    if (navigator.clipboard && navigator.clipboard.writeText) {
      return navigator.clipboard.writeText(text).then(() => true, () => legacyCopy(text));
    }
    return Promise.resolve(legacyCopy(text));
  }

  function legacyCopy(text) {   // where the Clipboard API is missing or refused
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (err) {
      ok = false;
    }
    area.remove();
    return ok;
  }

  function updateMessage(m) {
    const el = elements.get(m);
    if (el && el.isConnected) {
      fillMessage(el, m);
      const box = $("messages");
      box.scrollTop = box.scrollHeight;
    }
  }

  function renderList() {
    const list = $("conv-list");
    list.replaceChildren();
    for (const conv of state.conversations) {
      const item = document.createElement("li");
      item.className = conv.id === state.active ? "active" : "";
      item.dataset.session = conv.id;
      const title = document.createElement("button");
      title.type = "button";
      title.className = "title";
      title.textContent = conv.title || "New conversation";
      title.addEventListener("click", () => {
        state.active = conv.id;
        save();
        render();
        closeDrawer();
      });
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.title = "Delete this conversation";
      del.textContent = "×";
      del.addEventListener("click", () => deleteConversation(conv));
      item.append(title, del);
      list.appendChild(item);
    }
  }

  function renderDiagnostics() {
    const on = diagnosticsOn();
    $("diag-toggle").checked = on;
    $("diag").hidden = !on;
    if (!on) return;
    const conv = activeConv();
    const last = conv ? conv.messages.filter((m) => m.role === "assistant" && m.diag).pop() : null;
    $("diag-body").textContent = last
      ? JSON.stringify({ finish: last.finish, usage: last.usage, diag: last.diag }, null, 2)
      : "No turn with diagnostics yet.";
  }

  function updateControls() {
    const conv = activeConv();
    $("send").disabled = !authed || (conv !== null && busy(conv));
    $("stop").disabled = !(conv && busy(conv));
  }

  function render() {
    renderList();
    const box = $("messages");
    box.replaceChildren();
    const conv = activeConv();
    if (conv) {
      for (const m of conv.messages) {
        const el = document.createElement("div");
        fillMessage(el, m);
        elements.set(m, el);
        box.appendChild(el);
      }
      box.scrollTop = box.scrollHeight;
    }
    renderDiagnostics();
    updateControls();
  }

  // --- the conversation list: a column on wide screens, a drawer on narrow ones ---------------------
  function sidebarShown() {
    return NARROW.matches ? $("app").classList.contains("sidebar-open")
      : !$("app").classList.contains("sidebar-collapsed");
  }

  function setSidebar(show) {
    const app = $("app");
    if (NARROW.matches) {
      app.classList.toggle("sidebar-open", show);
    } else {
      app.classList.toggle("sidebar-collapsed", !show);
    }
    syncSidebarToggle();
  }

  function syncSidebarToggle() {
    const shown = sidebarShown();
    const toggle = $("sidebar-toggle");
    toggle.setAttribute("aria-expanded", shown ? "true" : "false");
    toggle.title = shown ? "Hide the conversations" : "Show the conversations";
  }

  // After a choice in the drawer, the drawer goes (on a wide screen the column stays).
  function closeDrawer() {
    if (NARROW.matches) setSidebar(false);
  }

  // A link like http://127.0.0.1:8850/#token=… signs in: the token is kept like a typed one and taken out of
  // the address bar (and so out of the history and bookmarks).
  function takeFragmentToken() {
    const hash = location.hash.replace(/^#/, "");
    if (!hash) return false;
    const rest = [];
    let token = null;
    for (const part of hash.split("&")) {
      if (part.startsWith("token=")) {
        try {
          token = decodeURIComponent(part.slice(6));
        } catch (err) {
          token = part.slice(6);
        }
      } else if (part) {
        rest.push(part);
      }
    }
    if (token === null) return false;
    const url = location.pathname + location.search + (rest.length ? "#" + rest.join("&") : "");
    window.history.replaceState(window.history.state, "", url);   // (`history` here is the conversation's)
    if (!token) return false;
    localStorage.setItem(TOKEN_KEY, token);
    return true;
  }

  // --- wiring -----------------------------------------------------------------------------------
  function init() {
    $("login-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token").value;
      if (!token) return;
      localStorage.setItem(TOKEN_KEY, token);
      $("token").value = "";
      $("login-error").textContent = "";
      connect();
    });
    $("forget-token").addEventListener("click", () => {
      localStorage.removeItem(TOKEN_KEY);
      refused = true;
      if (socket) socket.close();
      showLogin("");
    });
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = $("input");
      const text = input.value;
      if (!authed || !text.trim()) return;
      input.value = "";
      sendMessage(text);
    });
    $("input").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    loadOptions();
    $("opt-n").addEventListener("change", saveOptions);
    $("opt-temp").addEventListener("change", saveOptions);
    $("new-conv").addEventListener("click", () => {
      newConversation();
      closeDrawer();
      $("input").focus();
    });
    $("sidebar-toggle").addEventListener("click", () => setSidebar(!sidebarShown()));
    $("chat").addEventListener("click", () => closeDrawer());   // a tap beside the drawer closes it
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && NARROW.matches && sidebarShown()) setSidebar(false);
    });
    NARROW.addEventListener("change", syncSidebarToggle);
    syncSidebarToggle();
    $("diag-toggle").addEventListener("change", (event) => {
      localStorage.setItem(DIAG_KEY, event.target.checked ? "1" : "0");
      renderDiagnostics();
    });
    window.addEventListener("storage", (event) => {
      if (event.key === STORE_KEY && event.newValue) {
        // Another tab changed the conversations: merge its copy into ours (a conversation this tab streams
        // into stays ours).
        let fresh = null;
        try {
          fresh = cleanState(JSON.parse(event.newValue));
        } catch (err) {
          fresh = null;   // not JSON: keep ours
        }
        if (!fresh) return;
        adopt(merged(fresh));
        render();
      }
    });
    window.addEventListener("hashchange", () => {
      if (!takeFragmentToken()) return;
      refused = false;
      if (socket) {
        socket.close();   // onClosed reconnects, with the new token
      } else {
        connect();
      }
    });
    takeFragmentToken();
    if (localStorage.getItem(TOKEN_KEY)) {
      showApp();
      connect();
    } else {
      showLogin("");
    }
  }

  init();
})();
