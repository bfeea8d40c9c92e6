"""A DOM just large enough for the status page's script to run under node.js in a test: its tables come back
as text, one list of cells per row (tests/test_status.py, tests/test_status_runs.py)."""

FAKE_DOM = """
class FakeNode {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.style = {}; this.own = ""; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  replaceChildren(...c) { this.children = c; }
  set textContent(t) { this.own = String(t); this.children = []; }
  get textContent() { return this.own + this.children.map(c => c.textContent).join(""); }
}
const byId = {};
const document = {
  createElement: t => new FakeNode(t), createElementNS: (ns, t) => new FakeNode(t),
  createTextNode: t => { const n = new FakeNode("#text"); n.own = String(t); return n; },
  getElementById: id => byId[id] || (byId[id] = new FakeNode("div")), body: new FakeNode("body"),
};
document.getElementById("zb-data").textContent = process.argv[2];
"""
