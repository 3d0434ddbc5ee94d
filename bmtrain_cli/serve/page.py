"""The web chat page served at ``/``: one HTML file, no external assets (works offline). It keeps the
conversation in the page and streams each reply from /v1/chat/completions (server-sent events).
``/#ask=TEXT`` opens the page and sends TEXT."""

CHAT_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>bmtrain chat</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 0 auto; padding: 1rem; }
#log { border: 1px solid #ccc; border-radius: 6px; padding: .5rem; min-height: 18rem; overflow-y: auto; }
.msg { white-space: pre-wrap; margin: .4rem 0; padding: .4rem .6rem; border-radius: 6px; }
.user { background: #e8f0fe; } .assistant { background: #f1f3f4; } .error { background: #fde8e8; }
form { display: flex; gap: .5rem; margin-top: .6rem; } #input { flex: 1; padding: .5rem; }
#settings { display: flex; gap: .5rem; flex-wrap: wrap; margin-bottom: .6rem; font-size: .9rem; }
</style>
</head>
<body>
<h1>bmtrain chat</h1>
<div id="settings">
  <label>System <input id="system" size="28"></label>
  <label>Temperature <input id="temperature" type="number" value="0" min="0" max="2" step="0.1"></label>
  <label>Max tokens <input id="max_tokens" type="number" min="1" placeholder="auto"></label>
  <label>API key <input id="apikey" type="password" size="12"></label>
  <button id="reset" type="button">Reset</button>
</div>
<div id="log"></div>
<form id="form"><input id="input" autocomplete="off" placeholder="Type a message">
<button id="send" type="submit">Send</button></form>
<script>
const log = document.getElementById("log");
const form = document.getElementById("form");
const input = document.getElementById("input");
let history = [];
let busy = false;

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

async function send(text) {
  busy = true;
  history.push({role: "user", content: text});
  bubble("user", text);
  const out = bubble("assistant", "");
  const messages = [];
  const system = document.getElementById("system").value;
  if (system) messages.push({role: "system", content: system});
  const headers = {"Content-Type": "application/json"};
  const key = document.getElementById("apikey").value;
  if (key) headers["Authorization"] = "Bearer " + key;
  const body = {
    messages: messages.concat(history), stream: true,
    temperature: Number(document.getElementById("temperature").value),
  };
  const maxTokens = document.getElementById("max_tokens").value;
  if (maxTokens) body.max_tokens = Number(maxTokens);
  let reply = "";
  try {
    const resp = await fetch("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({error: {message: resp.statusText}}));
      throw new Error(err.error.message);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const delta = JSON.parse(data).choices[0]?.delta?.content;
        if (delta) { reply += delta; out.textContent = reply; log.scrollTop = log.scrollHeight; }
      }
    }
    history.push({role: "assistant", content: reply || " "});
    out.dataset.done = "1";
  } catch (e) {
    history.pop();
    out.className = "msg error";
    out.textContent = "error: " + e.message;
    out.dataset.done = "1";
  }
  busy = false;
}

form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = input.value.trim();
  if (!text || busy) return;
  input.value = "";
  send(text);
});
// the page's address followed by #ask=TEXT opens the page and sends TEXT
if (location.hash.startsWith("#ask=")) send(decodeURIComponent(location.hash.slice(5)));
document.getElementById("reset").addEventListener("click", () => { history = []; log.textContent = ""; });
</script>
</body>
</html>
"""
