// Runs the dashboard's own script (controlplane/api/static/dashboard.html) in Node against a
// live coordinator, with just enough of a DOM for it: elements by id that keep what the script
// writes. Usage: node dashboard_harness.js <base url> <page.html> [clicks...]
// Each click is "<element id>:<data-go value>" (a pager's button) or "rollouts:<rollout id>" (a
// row). After the first update and after each click's update, prints one JSON line: every
// element's textContent / innerHTML / hidden, and the URLs the update fetched.
"use strict";
const fs = require("fs");

const [base, pagePath, ...clicks] = process.argv.slice(2);
const html = fs.readFileSync(pagePath, "utf8");
const script = /<script>([\s\S]*)<\/script>/.exec(html)[1];

const elements = {};
for (const match of html.matchAll(/id="([^"]+)"/g)) {
  elements[match[1]] = {
    id: match[1], textContent: "", innerHTML: "", hidden: false, className: "", listeners: {},
    addEventListener(kind, fn) { this.listeners[kind] = fn; },
  };
}
const fetched = [];
const origin = new URL(base).origin;
let timers = [];

const sandbox = {
  document: { getElementById: (id) => elements[id] },
  location: { hash: "", origin },
  history: { replaceState() {} },
  fetch: (path, options) => { fetched.push(path); return fetch(new URL(path, base), options); },
  setTimeout: (fn) => { timers.push(fn); return timers.length; },
  clearTimeout: () => {},
  URL, Promise, Date, Math, JSON, Object, String, Error, console,
  encodeURIComponent, decodeURIComponent,
};
// The script ends each update by scheduling the next one: that is when an update is done.
const done = () => new Promise((resolve) => {
  const wait = () => (timers.length ? resolve() : setTimeout(wait, 10));
  wait();
});

function snapshot() {
  const out = { fetched: fetched.splice(0) };
  for (const [id, el] of Object.entries(elements)) {
    out[id] = { text: String(el.textContent), html: String(el.innerHTML), hidden: el.hidden };
  }
  console.log(JSON.stringify(out));
}

(async () => {
  new Function(...Object.keys(sandbox), script)(...Object.values(sandbox));
  await done();
  snapshot();
  for (const click of clicks) {
    timers = [];
    const [id, value] = click.split(":");
    const target = {
      closest: (selector) => (selector.includes("data-go") ? { dataset: { go: value } } : { dataset: { id: value } }),
    };
    elements[id === "rollouts" ? "rollouts" : `${id}-pager`].listeners.click({ target });
    await done();
    snapshot();
  }
  process.exit(0);
})().catch((error) => { console.error(error); process.exit(1); });
