// streamdet viewer: the stream list, live tiles (each frame's JPEG paired with its detections on
// one WebSocket per stream), events, video jobs and the /detect playground. A plain ES module: no build step and no
// request to anything but this server.

const KEY_STORAGE = "streamdet.apiKey";
const WATCH_STORAGE = "streamdet.watched";
const REFRESH_MS = 2000;
const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 10000;
// The server scales frames down to this width before JPEG-encoding them for the browser.
const TILE_MAX_WIDTH = 640;
// States in which a stream's last error is not shown as a current problem.
const HEALTHY_STATES = new Set(["running", "live", "streaming", "ok", "disabled"]);
// States in which a stream shows nothing now (the server's objects are empty then): its tile
// drops the last picture and its boxes.
const NOT_SHOWING = new Set(["disabled", "failed", "stopped"]);
// How the server's last_error begins for a file played once ("loop": false) that reached its
// end: the end it was asked for, no problem.
const FILE_ENDED = "the file ended";

// Ultralytics' palette, so colours look familiar to YOLO users.
const PALETTE = [
  "#FF3838", "#FF9D97", "#FF701F", "#FFB21D", "#CFD231", "#48F90A", "#92CC17", "#3DDB86",
  "#1A9334", "#00D4BB", "#2C99A8", "#00C2FF", "#344593", "#6473FF", "#0018EC", "#8438FF",
  "#520085", "#CB38FF", "#FF95C8", "#FF37C7",
];

const $ = (selector, root = document) => root.querySelector(selector);

// ---------------------------------------------------------------- text from outside

// Names, labels, class names and the server's messages (which echo what was sent) come from
// outside the page: shown among the page's own words, each is isolated (<bdi>), so
// right-to-left or override characters in it (U+202E) cannot reorder the words around it. A
// text is a list of parts: the page's own strings as they are, user(text) for the rest.
const user = (text) => ({ user: String(text ?? "") });

function flatParts(parts) {
  return [parts].flat(Infinity).filter((p) => p !== null && p !== undefined && p !== "");
}

// The text as a plain string (what textContent will say).
function plain(parts) {
  return flatParts(parts).map((p) => (typeof p === "object" ? p.user : String(p))).join("");
}

function setText(element, parts) {
  element.replaceChildren(...flatParts(parts).map((p) => {
    if (typeof p !== "object") return String(p);
    const bdi = document.createElement("bdi");
    bdi.textContent = p.user;
    return bdi;
  }));
}

// Where no element can hold it (an option, a tooltip, a label on a canvas): the same
// isolation written in the text, between FIRST STRONG ISOLATE and POP DIRECTIONAL ISOLATE.
const isolated = (text) => `\u2068${text}\u2069`;

// A stream or event that stopped where it was asked to: a file played once reached its end.
function endedAsAsked(state, error) {
  return state === "stopped" && String(error ?? "").startsWith(FILE_ENDED);
}

// What the page drew last, per canvas: tests and curious users can read it from the console.
const debug = { drawn: {}, palette: PALETTE, tiles: new Map() };
window.streamdet = debug;

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---------------------------------------------------------------- errors and server status

// The problems dismissed, by key: each stays away while it is the same (the stream list, shown
// again every refresh, brought a dismissed one back every 2 s), and comes back once it
// changes or after it went away.
const dismissed = new Map();

// text: a string or parts (user() for what came from outside); problem: what says it is the
// same problem (the text by default).
function showError(key, text, problem = plain(text)) {
  if (dismissed.get(key) === problem) return;
  dismissed.delete(key);
  let box = document.querySelector(`#errors [data-key="${CSS.escape(key)}"]`);
  if (!box) {
    box = document.createElement("div");
    box.className = "error";
    box.dataset.key = key;
    const message = document.createElement("span");
    const dismiss = document.createElement("button");
    dismiss.type = "button";
    dismiss.textContent = "Dismiss";
    dismiss.addEventListener("click", () => {
      dismissed.set(key, box.dataset.problem);
      box.remove();
    });
    box.append(message, dismiss);
    $("#errors").append(box);
  }
  box.dataset.problem = problem;
  if (box.firstChild.textContent !== plain(text)) setText(box.firstChild, text);
}

function clearError(key) {
  dismissed.delete(key);
  document.querySelector(`#errors [data-key="${CSS.escape(key)}"]`)?.remove();
}

function setServerUp(up, why = "") {
  const badge = $("#server-status");
  badge.dataset.up = String(up);
  document.body.dataset.serverUp = String(up); // greys out states and fps that went stale
  badge.textContent = up ? "connected" : "server unreachable";
  if (up) {
    clearError("server");
  } else {
    showError("server", ["Server unreachable (", user(why), `); retrying every ${REFRESH_MS / 1000} s.`]);
  }
}

// ---------------------------------------------------------------- API key and fetch

let keyPrompt = null;
// Set when the user cancels the prompt: calls then fail with the 401 shown on the page, and
// the prompt comes back only from the “API key” button, not every refresh.
let keyDeclined = false;

function askForKey(reason) {
  if (keyPrompt) return keyPrompt;
  const dialog = $("#key-dialog");
  const input = $("#key-input");
  setText($("#key-reason"), reason);
  input.value = "";
  keyPrompt = new Promise((resolve) => {
    const finish = (ok) => {
      $("#key-form").onsubmit = null;
      $("#key-cancel").onclick = null;
      dialog.oncancel = null;
      if (dialog.open) dialog.close();
      keyPrompt = null;
      keyDeclined = !ok;
      resolve(ok);
    };
    $("#key-form").onsubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORAGE, key);
      finish(true);
    };
    $("#key-cancel").onclick = () => finish(false);
    dialog.oncancel = () => finish(false);
  });
  dialog.showModal();
  input.focus();
  return keyPrompt;
}

async function errorText(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    const detail = body.detail ?? body.error ?? body;
    if (Array.isArray(detail)) {
      return detail.map((e) => `${(e.loc ?? []).slice(1).join(".")}: ${e.msg}`).join("; ");
    }
    return typeof detail === "string" ? detail : JSON.stringify(detail);
  } catch {
    return text.trim() || `${resp.status} ${resp.statusText}`;
  }
}

// Where the app is mounted: "" at the server's root, "/streamdet" behind a proxy's path
// prefix: the page's <base>, which the server sets to it (the page's own directory was "/"
// where a proxy served it at /streamdet without a redirect). Every URL of the page starts with it.
const BASE = new URL(".", document.baseURI).pathname.replace(/\/$/, "");

// A path the server handed out (an event's snapshot, thumbnail and clip, a job's files): it
// carries the prefix already, so api() takes it as it is.
const served = (path) => new URL(path, location.origin);

// fetch() with the session's API key; a 401 asks for a key and retries. path: the app's (under
// BASE), or a URL as it is (served()).
async function api(path, init = {}) {
  for (;;) {
    const headers = new Headers(init.headers ?? {});
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) headers.set("Authorization", `Bearer ${key}`);
    let resp;
    try {
      resp = await fetch(path instanceof URL ? path : BASE + path, { ...init, headers });
    } catch (err) {
      setServerUp(false, err.message);
      throw new ApiError(0, `server unreachable (${err.message})`);
    }
    setServerUp(true);
    if (resp.status === 401) {
      const detail = await errorText(resp);
      if (key) sessionStorage.removeItem(KEY_STORAGE);
      const reason = key
        ? ["The API key was refused (", user(detail), "). Enter another one:"]
        : ["This server needs an API key (", user(detail), ")."];
      if (!keyDeclined && (await askForKey(reason))) continue;
      showError("auth", "401 Unauthorized: this server needs an API key; use the “API key” button.");
      throw new ApiError(401, detail);
    }
    clearError("auth");
    if (!resp.ok) throw new ApiError(resp.status, `${resp.status}: ${await errorText(resp)}`);
    return resp;
  }
}

// ---------------------------------------------------------------- drawing

function classColor(classId) {
  const n = PALETTE.length;
  return PALETTE[((classId % n) + n) % n];
}

function textColorOn(hex) {
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  return 0.299 * r + 0.587 * g + 0.114 * b > 140 ? "#000000" : "#FFFFFF";
}

// Line width and font for overlays, scaled to the canvas; set on ctx, and returned.
function overlayStyle(ctx) {
  const { width, height } = ctx.canvas;
  const lineWidth = Math.max(2, Math.round(Math.min(width, height) / 200));
  const fontSize = Math.max(14, lineWidth * 6);
  ctx.lineWidth = lineWidth;
  ctx.font = `${fontSize}px sans-serif`;
  ctx.textBaseline = "top";
  return { width, height, lineWidth, fontSize };
}

// A shape's label: coloured text on a dark tag with its top left at (x, y), kept on the canvas.
function drawTag(ctx, text, x, y, color, fontSize) {
  const { width, height } = ctx.canvas;
  const tagWidth = ctx.measureText(text).width + 6;
  const left = Math.max(0, Math.min(x, width - tagWidth));
  const top = Math.max(0, Math.min(y, height - fontSize - 4));
  ctx.fillStyle = "rgba(0, 0, 0, 0.6)";
  ctx.fillRect(left, top, tagWidth, fontSize + 4);
  ctx.fillStyle = color;
  ctx.fillText(text, left + 3, top + 2);
}

// Draws boxes, class names and confidences; detections are in source pixels, scaled by sx/sy.
// Returns the shapes drawn, in canvas pixels.
function drawDetections(ctx, detections, sx, sy) {
  const { width, lineWidth, fontSize } = overlayStyle(ctx);
  const shapes = [];
  for (const det of detections) {
    const color = classColor(det.class_id);
    const [x1, y1, x2, y2] = [det.box[0] * sx, det.box[1] * sy, det.box[2] * sx, det.box[3] * sy];
    ctx.strokeStyle = color;
    ctx.strokeRect(x1, y1, x2 - x1, y2 - y1);
    // A tracked stream's detections carry the id that follows their object across frames.
    const track = det.track_id != null ? ` #${det.track_id}` : "";
    // In a zone, a tracked object also shows how long it has been there (its longest stay).
    const stays = Object.values(det.dwell_s ?? {});
    const dwell = stays.length ? ` ${Math.floor(Math.max(...stays))}s` : "";
    const label = `${det.class_name}${track} ${det.confidence.toFixed(2)}${dwell}`;
    const shown = `${isolated(det.class_name)}${track} ${det.confidence.toFixed(2)}${dwell}`;
    const labelHeight = fontSize + 4;
    const labelWidth = ctx.measureText(shown).width + 6;
    const labelTop = y1 - labelHeight >= 0 ? y1 - labelHeight : y1;
    // Kept inside the picture for boxes at its right edge.
    const labelLeft = Math.max(0, Math.min(x1 - lineWidth / 2, width - labelWidth));
    ctx.fillStyle = color;
    ctx.fillRect(labelLeft, labelTop, labelWidth, labelHeight);
    ctx.fillStyle = textColorOn(color);
    ctx.fillText(shown, labelLeft + 3, labelTop + 2);
    shapes.push({ x1, y1, x2, y2, color, label, lineWidth });
  }
  return shapes;
}

// The magenta of the outline on GET /streams/{id}/latest.jpg.
const REGION_COLOR = "#FF00FF";
const REGION_MIN_POINTS = 3;
const REGION_MAX_POINTS = 64;

// Draws one polygon ([[x, y], ...] in 0..1 of the frame): its outline in the current stroke
// style, filled with `fill` once it has three points (left open before), and its vertices in
// `vertexColor` when given (while it is being drawn).
function drawPolygon(ctx, points, fill, vertexColor = null) {
  const { width, height } = ctx.canvas;
  const xy = points.map(([x, y]) => [x * width, y * height]);
  if (!xy.length) return;
  ctx.beginPath();
  xy.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
  if (xy.length >= REGION_MIN_POINTS) {
    ctx.closePath();
    ctx.fillStyle = fill;
    ctx.fill();
  }
  ctx.stroke();
  if (vertexColor) {
    ctx.fillStyle = vertexColor;
    for (const [x, y] of xy) {
      ctx.beginPath();
      ctx.arc(x, y, Math.max(2, ctx.lineWidth) * 2, 0, 2 * Math.PI);
      ctx.fill();
    }
  }
}

// Draws a stream's region of interest as a dashed magenta outline with a faint fill; while it
// is being edited, also its vertices.
function drawRegion(ctx, points, editing) {
  if (!points?.length) return;
  const { width, height } = ctx.canvas;
  ctx.save();
  ctx.lineWidth = Math.max(2, Math.round(Math.min(width, height) / 200));
  ctx.strokeStyle = REGION_COLOR;
  ctx.setLineDash([8, 6]);
  drawPolygon(ctx, points, "rgba(255, 0, 255, 0.08)", editing ? REGION_COLOR : null);
  ctx.restore();
}

// Draws a stream's motion masks shaded, with a dotted white outline; the one being drawn
// also has its vertices.
function drawMasks(ctx, masks, editing) {
  const { width, height } = ctx.canvas;
  ctx.save();
  ctx.lineWidth = Math.max(1, Math.round(Math.min(width, height) / 300));
  ctx.strokeStyle = "#FFFFFF";
  ctx.setLineDash([2, 4]);
  for (const points of masks) drawPolygon(ctx, points, "rgba(0, 0, 0, 0.35)");
  if (editing) drawPolygon(ctx, editing, "rgba(0, 0, 0, 0.35)", "#FFFFFF");
  ctx.restore();
}

const LINE_COLOR = "#00FFFF";
// The tile buttons that open the shape editor.
const EDIT_BUTTONS = ".tile-region, .tile-line, .tile-zone, .tile-mask";
const FROM_FILE = "Declared in the server's streams file (--streams-file): change it there";

// Objects that crossed a counting line, each way, summed over classes.
function lineCounts(crossings, name) {
  const sum = (byClass) => Object.values(byClass ?? {}).reduce((a, b) => a + b, 0);
  return { in: sum(crossings?.[name]?.in), out: sum(crossings?.[name]?.out) };
}

// Draws a stream's counting lines ({name, points: [[x, y], [x, y]]} in 0..1 of the frame);
// returns their labels (name, objects that crossed each way) to draw over the boxes.
function drawLines(ctx, lines, crossings) {
  ctx.save();
  const { width, height, lineWidth, fontSize } = overlayStyle(ctx);
  const tags = [];
  for (const line of lines ?? []) {
    const [[ax, ay], [bx, by]] = line.points.map(([x, y]) => [x * width, y * height]);
    ctx.strokeStyle = LINE_COLOR;
    ctx.beginPath();
    ctx.moveTo(ax, ay);
    ctx.lineTo(bx, by);
    ctx.stroke();
    const counts = lineCounts(crossings, line.name);
    tags.push([`${isolated(line.name)}: ${counts.in} in · ${counts.out} out`, ax, ay + lineWidth, LINE_COLOR, fontSize]);
  }
  ctx.restore();
  return tags;
}

const ZONE_COLOR = "#FFD400";

// Objects in a zone now and entered so far, summed over classes.
function zoneCounts(counts, name) {
  const sum = (byClass) => Object.values(byClass ?? {}).reduce((a, b) => a + b, 0);
  return { now: sum(counts?.[name]?.now), entered: sum(counts?.[name]?.entered) };
}

// Draws a stream's zones ({name, points} in 0..1 of the frame) as dashed yellow outlines (the
// one being drawn with its vertices); returns their labels (name, objects standing in it) to
// draw over the boxes.
function drawZones(ctx, zones, counts, editing = null) {
  ctx.save();
  const { width, height, lineWidth, fontSize } = overlayStyle(ctx);
  const tags = [];
  ctx.strokeStyle = ZONE_COLOR;
  ctx.setLineDash([4, 4]);
  const all = editing ? [...zones, { name: "", points: editing, editing: true }] : zones;
  for (const zone of all) {
    const xy = zone.points.map(([x, y]) => [x * width, y * height]);
    if (!xy.length) continue;
    ctx.beginPath();
    xy.forEach(([x, y], i) => (i ? ctx.lineTo(x, y) : ctx.moveTo(x, y)));
    if (xy.length >= REGION_MIN_POINTS) ctx.closePath();
    ctx.stroke();
    if (zone.editing) {
      ctx.fillStyle = ZONE_COLOR;
      for (const [x, y] of xy) {
        ctx.beginPath();
        ctx.arc(x, y, lineWidth * 2, 0, 2 * Math.PI);
        ctx.fill();
      }
      continue;
    }
    tags.push([`${isolated(zone.name)}: ${zoneCounts(counts, zone.name).now}`, ...xy[0], ZONE_COLOR, fontSize]);
  }
  ctx.restore();
  return tags;
}

// A counting line being drawn: its ends so far, joined once there are two.
function drawLineEdit(ctx, points) {
  const { width, height } = ctx.canvas;
  const xy = points.map(([x, y]) => [x * width, y * height]);
  ctx.save();
  ctx.lineWidth = Math.max(2, Math.round(Math.min(width, height) / 200));
  ctx.strokeStyle = LINE_COLOR;
  ctx.fillStyle = LINE_COLOR;
  ctx.setLineDash([8, 6]);
  if (xy.length === 2) {
    ctx.beginPath();
    ctx.moveTo(...xy[0]);
    ctx.lineTo(...xy[1]);
    ctx.stroke();
  }
  for (const [x, y] of xy) {
    ctx.beginPath();
    ctx.arc(x, y, ctx.lineWidth * 2, 0, 2 * Math.PI);
    ctx.fill();
  }
  ctx.restore();
}

// ---------------------------------------------------------------- live tiles

function viewFps() {
  return Number($("#view-fps").value) || 5;
}

class Tile {
  constructor(stream) {
    this.id = stream.id;
    this.element = $("#tile-template").content.firstElementChild.cloneNode(true);
    this.element.dataset.streamId = stream.id;
    this.canvas = $(".tile-canvas", this.element);
    this.canvas.id = `tile-${stream.id}`;
    this.ws = null;
    this.meta = null; // JSON of the frame whose JPEG comes next
    this.drawing = false;
    this.queued = null; // newest pair that arrived while drawing; older ones are skipped
    this.current = null; // the pair on the canvas (its bitmap kept to redraw the overlay)
    this.region = null; // the stream's saved region of interest, from GET /streams
    this.editing = null; // the points of a region or line being drawn, or null
    this.editMode = null; // "region" or "line" while editing
    this.lines = []; // the stream's counting lines and their counts, from GET /streams
    this.crossings = {};
    this.zones = []; // the stream's zones and what stands in them, from GET /streams
    this.zoneCounts = {};
    this.masks = []; // the stream's motion masks (polygons), from GET /streams
    this.shownAt = [];
    this.received = 0; // frames received (picture and metadata), numbered in order
    this.receivedAt = -Infinity; // when the last one came (performance.now())
    this.blankUpTo = 0; // frames received up to this one are not drawn: the stream stopped showing after them
    this.blankFrame = 0; // nor frames of the stream's numbers up to this one (decoded before it stopped showing)
    this.state = stream.state; // the stream's state, from the list or the WebSocket
    this.stateError = null; // and its error
    this.lastDrawn = null; // the frame, capture time and size of the last picture drawn
    this.goneAt = null; // when the WebSocket said the stream was removed (close 1000 or 4404)
    this.backoffMs = RECONNECT_MIN_MS;
    this.retryTimer = null;
    this.closed = false;
    this.update(stream);
    this.setUpEditor();
    $("#grid").append(this.element);
    this.connect();
  }

  // stream: the stream as GET /streams (or PATCH) described it, asked for at `asked`
  // (performance.now()).
  update(stream, asked = performance.now()) {
    $(".tile-name", this.element).textContent = stream.name || stream.id;
    this.state = stream.state;
    this.stateError = stream.last_error ?? null;
    // Its WebSocket said the stream was removed, and a list asked for since still has it: it
    // was added again under its id (another client, a script's DELETE then POST): watched
    // still, so subscribe again. (One removed for good leaves the list, and the tile goes.)
    if (this.goneAt !== null && asked > this.goneAt) {
      this.goneAt = null;
      this.connError = "the stream is there again; reconnecting…";
      this.reconnectSoon();
    }
    // Showing nothing now (disabled: a privacy switch; failed; stopped), and no frame came
    // since the list was asked for: its last picture and boxes go. (The WebSocket's state
    // messages say so at once; this covers a tile without them.)
    if (NOT_SHOWING.has(stream.state) && this.receivedAt < asked) this.setBlank();
    this.renderPlaceholder();
    const badge = $(".tile-state", this.element);
    badge.textContent = stream.state ?? "?";
    badge.dataset.state = stream.state ?? "";
    // The rate shown is of the last frames drawn: with none coming (the camera lost, the
    // stream disabled) it said the rate from before for as long as the outage lasted. None
    // is overdue before twice their interval (a stream at max_fps 0.25 draws one each 4 s).
    const lastShown = this.shownAt[this.shownAt.length - 1];
    if (stream.state !== "live" || (lastShown !== undefined && performance.now() - lastShown > this.shownDueMs())) {
      this.shownAt = [];
      $(".tile-fps", this.element).textContent = stream.state === "live" ? "0.0 fps shown" : "";
    }
    this.streamError = streamProblem(stream);
    this.renderError();
    const region = stream.detect?.roi ?? null;
    const lines = stream.detect?.lines ?? [];
    const crossings = stream.crossings ?? {};
    const zones = stream.detect?.zones ?? [];
    const zoneCounts = stream.zones ?? {};
    const masks = stream.detect?.motion_mask ?? [];
    // A stream the server's streams file declares is changed in that file: no editors.
    this.fromFile = Boolean(stream.from_file);
    if (this.fromFile) {
      for (const button of this.element.querySelectorAll(EDIT_BUTTONS)) button.disabled = true;
    }
    $(".tile-name", this.element).title = this.fromFile ? FROM_FILE : "";
    const changed = JSON.stringify([region, lines, crossings, zones, zoneCounts, masks]) !==
      JSON.stringify([this.region, this.lines, this.crossings, this.zones, this.zoneCounts, this.masks]);
    Object.assign(this, { region, lines, crossings, zones, zoneCounts, masks });
    if (changed) this.paint();
  }

  // ---- region of interest and counting lines: click points on the picture, save with PATCH
  setUpEditor() {
    $(".tile-region", this.element).addEventListener("click", () => this.startEditing("region"));
    $(".tile-line", this.element).addEventListener("click", () => this.startEditing("line"));
    $(".tile-zone", this.element).addEventListener("click", () => this.startEditing("zone"));
    $(".tile-mask", this.element).addEventListener("click", () => this.startEditing("mask"));
    $(".edit-undo", this.element).addEventListener("click", () => {
      this.editing?.pop();
      this.editChanged();
    });
    $(".edit-save", this.element).addEventListener("click", () => this.saveEdit());
    $(".edit-clear", this.element).addEventListener("click", () => {
      this.patch({
        region: { roi: null }, line: { lines: [] }, zone: { zones: [] }, mask: { motion_mask: [] },
      }[this.editMode]);
    });
    $(".edit-cancel", this.element).addEventListener("click", () => this.stopEditing());
    this.canvas.addEventListener("click", (event) => this.addPoint(event));
  }

  startEditing(mode) {
    this.editMode = mode;
    this.editing = mode === "region" && this.region ? this.region.map(([x, y]) => [x, y]) : [];
    this.element.dataset.editing = mode;
    const [save, clear] = {
      region: ["Save region", "Whole frame"],
      line: ["Add line", "Remove all lines"],
      zone: ["Add zone", "Remove all zones"],
      mask: ["Add mask", "Remove all masks"],
    }[mode];
    $(".edit-save", this.element).textContent = save;
    $(".edit-clear", this.element).textContent = clear;
    const name = $(".shape-name", this.element);
    name.hidden = mode === "region" || mode === "mask";
    name.value = freeName(mode === "line" ? "line" : "zone", mode === "line" ? this.lines : this.zones);
    const classes = $(".shape-classes", this.element);
    classes.hidden = name.hidden;
    classes.value = "";
    const loiter = $(".shape-loiter", this.element);
    loiter.hidden = mode !== "zone";
    loiter.value = "";
    this.listShapes(mode);
    $(".tile-edit-bar", this.element).hidden = false;
    for (const button of this.element.querySelectorAll(EDIT_BUTTONS)) button.disabled = true;
    this.editChanged();
  }

  // In the line, zone and mask editors, one button per existing shape removes just that one.
  listShapes(mode) {
    const list = $(".shape-list", this.element);
    list.replaceChildren();
    if (mode === "mask") {
      this.masks.forEach((_, index) => {
        const button = document.createElement("button");
        button.type = "button";
        button.className = "shape-remove";
        button.textContent = `× mask ${index + 1}`;
        button.title = `remove motion mask ${index + 1}`;
        button.addEventListener("click", () => {
          this.patch({ motion_mask: this.masks.filter((_, other) => other !== index) });
        });
        list.append(button);
      });
      return;
    }
    const key = { line: "lines", zone: "zones" }[mode];
    if (!key) return;
    for (const shape of this[key]) {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "shape-remove";
      const only = shape.classes?.length ? shape.classes.join(", ") : "";
      const loiter = shape.loiter_s ? `loiter ${shape.loiter_s} s` : "";
      const about = [only, loiter].filter(Boolean).join(" · ");
      setText(button, about ? ["× ", user(shape.name), " (", user(about), ")"] : ["× ", user(shape.name)]);
      button.title = `remove ${mode} ${isolated(shape.name)}`;
      button.addEventListener("click", () => {
        this.patch({ [key]: this[key].filter((other) => other.name !== shape.name) });
      });
      list.append(button);
    }
  }

  stopEditing() {
    this.editing = null;
    this.editMode = null;
    delete this.element.dataset.editing;
    $(".tile-edit-bar", this.element).hidden = true;
    for (const button of this.element.querySelectorAll(EDIT_BUTTONS)) {
      button.disabled = !this.current || this.fromFile;
    }
    this.paint();
  }

  addPoint(event) {
    if (!this.editing) return;
    const most = this.editMode === "line" ? 2 : REGION_MAX_POINTS;
    if (this.editing.length >= most) {
      this.editHint(this.editMode === "line"
        ? "A line has two points: undo one to move it."
        : `A ${this.editMode} has at most ${REGION_MAX_POINTS} points.`);
      return;
    }
    // The canvas is scaled by CSS: positions are taken relative to its box on the page.
    const box = this.canvas.getBoundingClientRect();
    const rel = (v) => Math.round(Math.min(1, Math.max(0, v)) * 10000) / 10000;
    this.editing.push([rel((event.clientX - box.left) / box.width), rel((event.clientY - box.top) / box.height)]);
    this.editChanged();
  }

  editChanged() {
    const n = this.editing.length;
    const points = `${n} point${n === 1 ? "" : "s"}`;
    if (this.editMode === "region") {
      this.editHint(n === 0
        ? "Click on the picture to place the region's corners; objects standing outside it are not detected."
        : `${points}; objects whose box's bottom centre is outside are dropped.`);
    } else if (this.editMode === "mask") {
      this.editHint(n < REGION_MIN_POINTS
        ? `${points}: click the corners of what changes without being motion (the camera's clock, a tree).`
        : `${points}; add the mask: changes inside it no longer count as motion.`);
    } else if (this.editMode === "zone") {
      this.editHint(n < REGION_MIN_POINTS
        ? `${points}: click the zone's corners; objects standing in it are counted (and, tracked, each entry once).`
        : `${points}; name the zone and add it.`);
    } else {
      this.editHint(n < 2
        ? `${points}: click the line's two ends; crossing it towards your right as you look from the first to the second counts as "in".`
        : "Name the line and add it; tracked objects crossing it are counted each way.");
    }
    $(".edit-undo", this.element).disabled = n === 0;
    this.paint();
  }

  editHint(text) {
    $(".edit-hint", this.element).textContent = text;
  }

  saveEdit() {
    if (this.editMode === "region") {
      if (this.editing.length < REGION_MIN_POINTS) {
        this.editHint(`A region needs at least ${REGION_MIN_POINTS} points: click on the picture.`);
        return;
      }
      this.patch({ roi: this.editing });
      return;
    }
    if (this.editMode === "mask") {
      if (this.editing.length < REGION_MIN_POINTS) {
        this.editHint(`A mask needs at least ${REGION_MIN_POINTS} points: click on the picture.`);
        return;
      }
      // A mask only matters to motion gating: adding one switches it on.
      this.patch({ motion: true, motion_mask: [...this.masks, this.editing] });
      return;
    }
    const name = $(".shape-name", this.element).value.trim();
    // Classes it counts (the server checks the names: a misspelt one is an error shown here).
    const listed = $(".shape-classes", this.element).value.split(",").map((c) => c.trim()).filter(Boolean);
    const classes = listed.length ? listed : null;
    if (this.editMode === "zone") {
      if (this.editing.length < REGION_MIN_POINTS || !name) {
        this.editHint(`A zone needs at least ${REGION_MIN_POINTS} points and a name.`);
        return;
      }
      const loiter = Number($(".shape-loiter", this.element).value);
      const zone = { name, points: this.editing, classes };
      if (loiter > 0) {
        zone.loiter_s = loiter;
        // How long an object stays is measured per tracked object: loitering turns tracking on.
        this.patch({ track: true, zones: [...this.zones, zone] });
        return;
      }
      this.patch({ zones: [...this.zones, zone] });
      return;
    }
    if (this.editing.length !== 2 || !name) {
      this.editHint("A line needs two points and a name.");
      return;
    }
    // Crossings are counted per tracked object: adding a line switches tracking on.
    this.patch({ track: true, lines: [...this.lines, { name, points: this.editing, classes }] });
  }

  async patch(changes) {
    const name = $(".tile-name", this.element).textContent;
    const asked = performance.now();
    try {
      const resp = await api(`/streams/${encodeURIComponent(this.id)}`, {
        method: "PATCH",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(changes),
      });
      const stream = await resp.json();
      clearError(`edit:${this.id}`);
      this.stopEditing();
      this.update(stream, asked);
      refreshStreams();
    } catch (err) {
      showError(`edit:${this.id}`, ["Changing stream ", user(name), " failed: ", user(err.message)]);
    }
  }

  url() {
    const params = new URLSearchParams({
      frames: "jpeg",
      max_fps: String(viewFps()),
      max_width: String(TILE_MAX_WIDTH),
      states: "true", // the stream's state changes too, in order with its frames
    });
    const key = sessionStorage.getItem(KEY_STORAGE);
    // Browsers cannot set headers on a WebSocket: the key goes as RFC 6750's query parameter.
    if (key) params.set("access_token", key);
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    return `${proto}//${location.host}${BASE}/ws/streams/${encodeURIComponent(this.id)}?${params}`;
  }

  connect() {
    this.retryTimer = null;
    const ws = new WebSocket(this.url());
    ws.binaryType = "blob";
    this.ws = ws;
    this.meta = null;
    // A new connection sends no frame from before it, and after a server restart frame
    // numbers start again from 0: the tile stayed blank until they passed the old ones.
    this.blankFrame = 0;
    ws.onopen = () => {
      this.backoffMs = RECONNECT_MIN_MS;
      this.connError = null;
      this.renderError();
    };
    ws.onmessage = (event) => this.onMessage(event);
    ws.onclose = (event) => {
      if (ws === this.ws && !this.closed) this.onClose(event);
    };
  }

  onMessage(event) {
    if (typeof event.data === "string") {
      let msg;
      try {
        msg = JSON.parse(event.data);
      } catch {
        return;
      }
      if (msg.type === "stream_state") {
        this.onState(msg);
        return;
      }
      if (msg.error) {
        this.connError = ["server: ", user(msg.error)];
        this.renderError();
        return;
      }
      // A JSON message announcing a JPEG is drawn only together with that JPEG, so boxes
      // never land on another frame's picture.
      this.meta = msg.jpeg ? msg : null;
      return;
    }
    if (!this.meta) return;
    const pair = { meta: this.meta, blob: event.data, number: ++this.received };
    this.receivedAt = performance.now();
    this.meta = null;
    if (this.drawing) {
      this.queued = pair;
      return;
    }
    this.show(pair);
  }

  async show(pair) {
    this.drawing = true;
    try {
      const bitmap = await createImageBitmap(pair.blob);
      if (this.closed) {
        bitmap.close();
        return;
      }
      if (pair.number <= this.blankUpTo || pair.meta.frame <= this.blankFrame) {
        // From before the stream stopped showing: received before its state message, or
        // decoded before it (a file's last frame, still in the engine when the file ended,
        // comes after the message that it was played to its end).
        bitmap.close();
      } else {
        this.current?.bitmap.close();
        this.current = { meta: pair.meta, bitmap };
        if (!this.editing) {
          for (const b of this.element.querySelectorAll(EDIT_BUTTONS)) b.disabled = this.fromFile;
        }
        this.paint();
        this.countFrame(pair.meta);
      }
    } catch (err) {
      this.connError = `cannot show frame: ${err.message}`;
      this.renderError();
    } finally {
      this.drawing = false;
    }
    const next = this.queued;
    this.queued = null;
    if (next && !this.closed) this.show(next);
  }

  // A state change from the WebSocket (?states=true): a stream that shows nothing now
  // (disabled, failed, played to its end) drops its picture, and frames decoded before the
  // change that come after it (in the engine then) are not drawn.
  onState(msg) {
    this.state = msg.state;
    this.stateError = msg.error ?? null;
    if (NOT_SHOWING.has(msg.state)) {
      this.blankFrame = Math.max(this.blankFrame, msg.frame ?? 0);
      this.setBlank();
    }
    this.renderPlaceholder();
  }

  // The stream shows nothing now: the last picture and its boxes go (the canvas stays black
  // at its size, with the stream's region, zones and lines, so an editor open stays usable),
  // and so do frames received until now that are not drawn yet; the next frame received
  // brings the picture back.
  setBlank() {
    this.blankUpTo = this.received;
    this.queued = null;
    if (!this.current) return;
    this.current.bitmap.close();
    this.current = null;
    if (!this.editing) {
      for (const b of this.element.querySelectorAll(EDIT_BUTTONS)) b.disabled = true;
    }
    this.paint();
  }

  // Over a tile without a picture, a line saying why.
  renderPlaceholder() {
    const box = $(".tile-blank", this.element);
    box.hidden = Boolean(this.current);
    if (box.hidden) return;
    const state = this.state;
    let text;
    if (state === "disabled") text = "disabled: its camera is closed, nothing is shown";
    else if (endedAsAsked(state, this.stateError)) text = "played to its end: nothing to show";
    else if (state === "stopped" || state === "failed") text = `${state}: nothing to show`;
    else if (state === "removed") text = "removed";
    else text = `${state ?? "connecting"}: waiting for a picture…`;
    box.textContent = text;
  }

  // Draws the current frame (black where it shows nothing now), the region (the one being
  // edited, else the saved one), masks, zones and lines under the boxes, and the boxes.
  paint() {
    if (this.closed) return;
    this.renderPlaceholder();
    if (!this.current && !this.canvas.width) return; // no picture yet: nothing to draw on
    const meta = this.current?.meta ?? null;
    const ctx = this.canvas.getContext("2d");
    if (this.current) {
      const { bitmap } = this.current;
      this.canvas.width = bitmap.width;
      this.canvas.height = bitmap.height;
      ctx.drawImage(bitmap, 0, 0);
      this.lastDrawn = { frame: meta.frame, capturedAt: meta.captured_at, size: [meta.width, meta.height] };
    } else {
      this.canvas.width = this.canvas.width; // cleared, its context's state reset
      ctx.fillStyle = "#000000";
      ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
    }
    const region = this.editMode === "region" ? this.editing : this.region;
    drawRegion(ctx, region, this.editMode === "region");
    drawMasks(ctx, this.masks, this.editMode === "mask" ? this.editing : null);
    const tags = [
      ...drawZones(ctx, this.zones, this.zoneCounts, this.editMode === "zone" ? this.editing : null),
      ...drawLines(ctx, this.lines, this.crossings),
    ];
    if (this.editMode === "line") drawLineEdit(ctx, this.editing);
    const shapes = meta ? drawDetections(
      ctx, meta.detections ?? [], this.canvas.width / meta.width, this.canvas.height / meta.height,
    ) : [];
    // Zone and line counts over the boxes: a box's label never hides them.
    for (const tag of tags) drawTag(ctx, ...tag);
    // blank: the state in which it shows nothing now (frame: the last one drawn), else null.
    debug.drawn[this.canvas.id] = {
      frame: this.lastDrawn?.frame ?? -1, capturedAt: this.lastDrawn?.capturedAt ?? null, shapes,
      detections: meta?.detections ?? [], size: this.lastDrawn?.size ?? null,
      blank: meta ? null : this.state ?? "", region, editing: this.editMode, lines: this.lines,
      zones: this.zones, masks: this.masks,
    };
  }

  // When the next frame is overdue: after twice the last frames' interval, 3 s at least.
  shownDueMs() {
    const times = this.shownAt;
    if (times.length < 2) return 3000;
    return Math.max(3000, (2 * (times[times.length - 1] - times[0])) / (times.length - 1));
  }

  // The rate of the frames drawn in the last 3 s; where fewer than two were (a stream at
  // max_fps 0.25: it said "0.0 fps shown" for ever), of the last ones within a minute.
  countFrame(meta) {
    const now = performance.now();
    this.shownAt.push(now);
    const recent = this.shownAt.filter((t) => now - t <= 3000);
    while (this.shownAt.length > 1 && (now - this.shownAt[0] > 60000 || (recent.length >= 2 && now - this.shownAt[0] > 3000) || this.shownAt.length > 50)) {
      this.shownAt.shift();
    }
    const span = (now - this.shownAt[0]) / 1000;
    const fps = span > 0 ? (this.shownAt.length - 1) / span : 0;
    const latency = meta.latency_ms != null ? ` · ${Math.round(meta.latency_ms)} ms` : "";
    $(".tile-fps", this.element).textContent = `${fps.toFixed(1)} fps shown${latency}`;
  }

  async onClose(event) {
    const why = event.reason ? [": ", user(event.reason)] : "";
    if (event.code === 4404 || event.code === 1000) {
      // Removed. The next list says whether for good (the tile goes with the stream from the
      // list) or added again under its id since: then update() subscribes again. It returned
      // here for good: a stream added again kept a dead tile, ticked Watch and no viewer.
      this.goneAt = performance.now();
      this.state = "removed";
      this.setBlank();
      this.renderPlaceholder();
      this.connError = ["stream no longer exists", why];
      this.renderError();
      refreshStreams();
      return;
    }
    if (event.code === 1008) {
      const ok = !keyDeclined && await askForKey(["The live view needs an API key (", `${event.code}`, why, ")."]);
      if (!ok) {
        this.connError = "401 Unauthorized: enter an API key with the “API key” button";
        this.renderError();
        return;
      }
      this.backoffMs = RECONNECT_MIN_MS;
    } else if (event.code === 4400) {
      this.connError = ["the server refused the viewer's options", why];
      this.renderError();
      return;
    } else {
      // 1006 says nothing: a refused key (HTTP 401 on the handshake) looks the same as a
      // server that is gone, so ask the REST API, which tells the two apart.
      refreshStreams();
      this.connError = [`connection lost (code ${event.code}`, why, "); reconnecting…"];
      this.renderError();
    }
    this.reconnectSoon();
  }

  reconnectSoon() {
    if (this.retryTimer || this.closed) return;
    this.retryTimer = setTimeout(() => this.connect(), this.backoffMs);
    this.backoffMs = Math.min(this.backoffMs * 2, RECONNECT_MAX_MS);
  }

  reconnectNow() {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    const old = this.ws;
    this.ws = null;
    old?.close(1000, "viewer settings changed");
    this.connect();
  }

  renderError() {
    const parts = [this.streamError, this.connError].filter(Boolean);
    const line = $(".tile-error", this.element);
    setText(line, joinParts(parts, " — "));
    line.hidden = parts.length === 0;
  }

  close() {
    this.closed = true;
    this.current?.bitmap.close();
    this.current = null;
    clearTimeout(this.retryTimer);
    this.ws?.close(1000, "viewer closed the tile");
    this.element.remove();
    delete debug.drawn[this.canvas.id];
  }
}

// ---------------------------------------------------------------- stream list

const streams = new Map();
const tiles = debug.tiles;
const watched = new Set(JSON.parse(sessionStorage.getItem(WATCH_STORAGE) ?? "[]"));

function saveWatched() {
  sessionStorage.setItem(WATCH_STORAGE, JSON.stringify([...watched]));
}

function streamFps(stream) {
  const fps = stream.fps_processed ?? stream.fps_out ?? stream.fps;
  return typeof fps === "number" ? fps.toFixed(1) : "–";
}

// What is wrong with a stream now, as parts (null: nothing). A file played once that reached
// its end is not a problem: it ended as asked.
function streamProblem(stream) {
  const error = stream.last_error ?? stream.error;
  if (!error || HEALTHY_STATES.has(stream.state) || endedAsAsked(stream.state, error)) return null;
  return [stream.state ?? "error", ": ", user(error)];
}

// Joins lists of parts with a separator.
function joinParts(lists, separator) {
  return lists.flatMap((parts, i) => (i ? [separator, parts] : [parts]));
}

function streamObjects(stream) {
  const detect = stream.detect;
  if (!detect) return "–";
  const classes = detect.classes === null ? "all" : joinParts(detect.classes.map(user), ", ");
  const text = [classes, ` ≥ ${Number(detect.conf).toFixed(2)}`];
  if (detect.roi) text.push(" · region");
  for (const line of detect.lines ?? []) {
    const counts = lineCounts(stream.crossings, line.name);
    text.push(" · ", user(line.name), ` ${counts.in} in / ${counts.out} out`);
  }
  for (const zone of detect.zones ?? []) {
    const counts = zoneCounts(stream.zones, zone.name);
    text.push(" · ", user(zone.name), ` ${counts.now} now`);
    if (detect.track) text.push(` / ${counts.entered} entered`);
  }
  if (detect.track) {
    const counted = Object.entries(stream.tracked ?? {}).map(([name, n]) => [`${n} `, user(name)]);
    text.push(" · tracked", counted.length ? [": ", joinParts(counted, ", ")] : "");
  }
  return text;
}

// list: GET /streams' streams, asked for at `asked` (performance.now()).
function renderStreams(list, asked) {
  const rows = $("#stream-rows");
  const seen = new Set();
  for (const [id, at] of leftWatched) {
    if (asked - at > REWATCH_MS) leftWatched.delete(id);
  }
  for (const stream of list) {
    seen.add(stream.id);
    streams.set(stream.id, stream);
    if (leftWatched.delete(stream.id)) {
      watched.add(stream.id);
      saveWatched();
    }
    let row = rows.querySelector(`tr[data-id="${CSS.escape(stream.id)}"]`);
    if (!row) {
      row = document.createElement("tr");
      row.dataset.id = stream.id;
      row.innerHTML = `<td><input type="checkbox" class="watch"></td>
        <td><span class="name"></span><small class="objects muted"></small></td>
        <td class="state"></td><td class="fps"></td>
        <td><button type="button" class="toggle"></button>
          <button type="button" class="remove">Remove</button></td>`;
      $(".watch", row).addEventListener("change", (e) => setWatched(stream.id, e.target.checked));
      $(".toggle", row).addEventListener("click", () =>
        setEnabled(stream.id, !streams.get(stream.id)?.enabled));
      $(".remove", row).addEventListener("click", () => removeStream(stream.id));
      rows.append(row);
    }
    const name = stream.name || stream.id;
    $(".name", row).textContent = name;
    $(".name", row).title = isolated(stream.url ?? "");
    $(".watch", row).checked = watched.has(stream.id);
    $(".watch", row).setAttribute("aria-label", `watch ${name}`);
    $(".remove", row).setAttribute("aria-label", `remove ${name}`);
    // A stream the server's streams file declares is changed in that file, not here.
    $(".remove", row).disabled = Boolean(stream.from_file);
    $(".remove", row).title = stream.from_file ? FROM_FILE : "";
    // Disable closes the camera and detects nothing (a privacy switch); Enable opens it again.
    const toggle = $(".toggle", row);
    toggle.textContent = stream.enabled === false ? "Enable" : "Disable";
    toggle.title = stream.enabled === false
      ? "Open the camera again and detect"
      : "Close the camera and detect nothing, keeping its settings and counts";
    toggle.setAttribute("aria-label", `${toggle.textContent.toLowerCase()} ${name}`);
    $(".state", row).textContent = stream.state ?? "?";
    $(".fps", row).textContent = streamFps(stream);
    setText($(".objects", row), streamObjects(stream));
    $(".objects", row).title = "classes and minimum confidence detected on this stream";
    const problem = streamProblem(stream);
    if (problem) {
      row.dataset.error = plain(problem);
      $(".state", row).title = isolated(plain(problem));
      // A dismissed one stays away while the stream's error is the same.
      showError(`stream:${stream.id}`, ["Stream ", user(name), ": ", problem], stream.last_error ?? stream.error);
    } else {
      delete row.dataset.error;
      $(".state", row).title = "";
      clearError(`stream:${stream.id}`);
    }
    tiles.get(stream.id)?.update(stream, asked);
  }
  for (const row of [...rows.children]) {
    if (!seen.has(row.dataset.id)) {
      forgetStream(row.dataset.id);
    }
  }
  $("#no-streams").hidden = list.length > 0;
  syncTiles();
  updateEventStreams();
}

// Watched streams that left the list, and when: one added again under its id soon after (a
// script's DELETE then POST, the page's list read between the two: its WebSocket's close
// asks for one at once) is watched again. It was forgotten, unticked, its tile gone.
const REWATCH_MS = 60000;
const leftWatched = new Map();

function forgetStream(id) {
  if (watched.has(id)) leftWatched.set(id, performance.now());
  streams.delete(id);
  $(`#stream-rows tr[data-id="${CSS.escape(id)}"]`)?.remove();
  clearError(`stream:${id}`);
  clearError(`edit:${id}`);
  watched.delete(id);
  saveWatched();
  syncTiles();
  updateEventStreams();
}

function setWatched(id, on) {
  if (on) watched.add(id);
  else watched.delete(id);
  saveWatched();
  syncTiles();
}

function syncTiles() {
  for (const [id, tile] of tiles) {
    if (!watched.has(id) || !streams.has(id)) {
      tile.close();
      tiles.delete(id);
    }
  }
  for (const id of watched) {
    const stream = streams.get(id);
    if (stream && !tiles.has(id)) tiles.set(id, new Tile(stream));
  }
  $("#no-tiles").hidden = tiles.size > 0;
}

async function refreshStreams() {
  try {
    const asked = performance.now();
    const body = await (await api("/streams")).json();
    renderStreams(Array.isArray(body) ? body : body.streams ?? [], asked);
    clearError("streams");
  } catch (err) {
    if (err.status > 0 && err.status !== 401) {
      showError("streams", ["Listing streams failed: ", user(err.message)]);
    }
  }
}

async function refreshLoop() {
  await refreshStreams();
  setTimeout(refreshLoop, REFRESH_MS);
}

async function addStream(event) {
  event.preventDefault();
  const form = event.target;
  const data = new FormData(form);
  const body = { url: String(data.get("url")).trim() };
  const name = String(data.get("name") ?? "").trim();
  if (name) body.name = name;
  const maxFps = String(data.get("max_fps") ?? "").trim();
  if (maxFps) body.max_fps = Number(maxFps);
  const classes = String(data.get("classes") ?? "").trim();
  if (classes) body.classes = classes;
  const conf = String(data.get("conf") ?? "").trim();
  if (conf) body.conf = Number(conf);
  if (data.get("track")) body.track = true;
  if (data.get("clips")) body.clips = true;
  if (data.get("motion")) body.motion = true;
  try {
    const resp = await api("/streams", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const created = await resp.json();
    clearError("add");
    form.reset();
    watched.add(created.id);
    saveWatched();
    await refreshStreams();
  } catch (err) {
    showError("add", ["Adding the stream failed: ", user(err.message)]);
  }
}

async function setEnabled(id, enabled) {
  try {
    const resp = await api(`/streams/${encodeURIComponent(id)}`, {
      method: "PATCH",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ enabled }),
    });
    await resp.json();
    clearError(`enable:${id}`);
    refreshStreams();
  } catch (err) {
    showError(`enable:${id}`, [enabled ? "Enabling" : "Disabling", " stream ", user(id), " failed: ", user(err.message)]);
  }
}

async function removeStream(id) {
  try {
    await api(`/streams/${encodeURIComponent(id)}`, { method: "DELETE" });
    clearError(`remove:${id}`);
    forgetStream(id);
  } catch (err) {
    if (err.status === 404) forgetStream(id);
    else showError(`remove:${id}`, ["Removing stream ", user(id), " failed: ", user(err.message)]);
  }
}

// ---------------------------------------------------------------- /detect playground

let playgroundFile = null;

async function runPlayground(file) {
  playgroundFile = file;
  const summary = $("#pg-summary");
  const list = $("#pg-list");
  setText(summary, ["Detecting ", user(file.name), "…"]);
  list.replaceChildren();
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch {
    showError("playground", [user(file.name), " is not an image this browser can show; pick a JPEG, PNG or WebP."]);
    summary.textContent = "";
    return;
  }
  try {
    const form = new FormData();
    form.append("image", file, file.name);
    const conf = encodeURIComponent($("#pg-conf").value || "0.25");
    const result = await (await api(`/detect?conf=${conf}`, { method: "POST", body: form })).json();
    clearError("playground");
    const canvas = $("#pg-canvas");
    canvas.width = bitmap.width;
    canvas.height = bitmap.height;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(bitmap, 0, 0);
    const shapes = drawDetections(
      ctx, result.detections, bitmap.width / result.image.width, bitmap.height / result.image.height,
    );
    debug.drawn[canvas.id] = { file: file.name, shapes, detections: result.detections };
    const timing = result.timing_ms ?? {};
    setText(summary, [user(file.name), `: ${result.detections.length} detection(s), ` +
      `${result.image.width}×${result.image.height}, ${timing.total ?? "?"} ms (`, user(result.model), ")"]);
    for (const det of result.detections) {
      const item = document.createElement("li");
      setText(item, [user(det.class_name), ` ${det.confidence.toFixed(2)} ` +
        `[${det.box.map((v) => Math.round(v)).join(", ")}]`]);
      item.style.borderLeft = `6px solid ${classColor(det.class_id)}`;
      item.style.paddingLeft = "4px";
      list.append(item);
    }
  } catch (err) {
    summary.textContent = "";
    showError("playground", ["Detection failed for ", user(file.name), ": ", user(err.message)]);
  } finally {
    bitmap.close();
  }
}

function setUpPlayground() {
  const zone = $("#drop-zone");
  $("#pick").addEventListener("change", (event) => {
    const [file] = event.target.files;
    if (file) runPlayground(file);
  });
  // The drop zone takes the keyboard's focus: Enter or Space opens the file picker (its input
  // is hidden, so the Tab order never reached it, and the playground was mouse-only).
  zone.setAttribute("role", "button");
  zone.setAttribute("aria-label", "pick an image to detect on, or drop one here");
  zone.addEventListener("keydown", (event) => {
    if (event.target === zone && (event.key === "Enter" || event.key === " ")) {
      event.preventDefault();
      $("#pick").click();
    }
  });
  zone.addEventListener("dragover", (event) => {
    event.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("over");
    const file = event.dataTransfer?.files?.[0];
    if (file) runPlayground(file);
  });
  $("#pg-conf").addEventListener("change", () => {
    if (playgroundFile) runPlayground(playgroundFile);
  });
}

// ---------------------------------------------------------------- events

const EVENTS_SHOWN = 50;
const EVENTS_RETRY_MS = 3000;
let eventSource = null;
let eventRetry = null;
// Each (re)connection's number: one overtaken by a newer (filters changed while its first page
// was loading) drops what it fetched and opens nothing. Two at once each opened an
// EventSource; the first was never closed, its events shown twice, and ~6 of them held every
// connection Chromium allows to the server: the whole page hung.
let eventsGeneration = 0;
let lastEventId = null; // the newest event shown: where a new connection reads on from
debug.events = [];

// One event (GET /events' JSON) as a sentence, in parts: "car #12 entered dock".
function eventText(e) {
  const who = [user(e.class_name), ` #${e.track_id}`];
  if (e.type === "line_crossing") return [who, " crossed ", user(e.line), " (", user(e.direction), ")"];
  if (e.type === "zone_enter") return [who, " entered ", user(e.zone)];
  if (e.type === "zone_loiter") {
    return [who, " loitering in ", user(e.zone), ` for ${Number(e.dwell_s).toFixed(0)} s`];
  }
  if (e.type === "manual") return [user(e.label), " (created from outside)"];
  if (e.type === "stream_state") {
    if (e.state === "live") return "is live";
    if (e.state === "removed") return "was removed";
    if (e.state === "disabled") return "was disabled";
    // A file played once ("loop": false) that reached its end stopped as it was asked to.
    if (endedAsAsked(e.state, e.error)) return "played to its end";
    const why = e.error ? [": ", user(e.error)] : "";
    if (e.state === "failed") return ["failed", why];
    if (e.state === "stopped") return ["stopped", why];
    return ["lost its source", why];
  }
  if (e.type === "zone_exit") {
    const how = e.lost ? " lost in " : " left ";
    return [who, how, user(e.zone), ` after ${Number(e.dwell_s).toFixed(1)} s`];
  }
  return [user(JSON.stringify(e))];
}

function showEvent(e) {
  if (e.type === "missed") {
    showError("events", `${e.missed} event(s) left the server's log before this page read them.`);
    return;
  }
  debug.events.push(e);
  if (debug.events.length > EVENTS_SHOWN) debug.events.shift();
  lastEventId = e.id;
  const li = document.createElement("li");
  li.className = `event ${e.type}`;
  const at = new Date(e.captured_at * 1000).toLocaleTimeString(undefined, { hour12: false });
  const stream = streams.get(e.stream_id)?.name || e.stream_name || e.stream_id;
  const text = document.createElement("span");
  text.className = "event-text";
  const sentence = [at, " · ", user(stream), " · ", eventText(e)];
  setText(text, sentence);
  if (e.thumbnail) li.append(eventThumbnail(e, () => showSnapshot(e, sentence)), " ");
  li.append(text, " ");
  if (e.snapshot) {
    li.append(eventButton("event-snapshot", "Snapshot", "The frame it happened in", () =>
      showSnapshot(e, sentence)));
  }
  if (e.clip) {
    li.append(" ", eventButton("event-clip", "Clip", "The video around it", () =>
      showClip(e, sentence)));
  }
  const list = $("#event-list");
  list.prepend(li);
  while (list.children.length > EVENTS_SHOWN) {
    const gone = list.lastElementChild.querySelector("img.event-thumb");
    if (gone?.src) URL.revokeObjectURL(gone.src);
    list.lastElementChild.remove();
  }
  $("#no-events").hidden = true;
}

// The event's object, cut from its frame (GET /events/{id}/thumbnail.jpg, fetched with the API
// key); a click shows the whole frame. One the server no longer has is left out.
function eventThumbnail(e, onclick) {
  const image = document.createElement("img");
  image.className = "event-thumb";
  image.alt = `${isolated(e.class_name)} #${e.track_id}`;
  image.title = "The object; click for the frame it was in";
  image.onclick = onclick;
  api(served(e.thumbnail))
    .then((resp) => resp.blob())
    .then((blob) => { image.src = URL.createObjectURL(blob); })
    .catch(() => image.remove());
  return image;
}

function eventButton(className, label, title, onclick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = className;
  button.textContent = label;
  button.title = title;
  button.onclick = onclick;
  return button;
}

// An event's snapshot (GET /events/{id}/snapshot.jpg, fetched with the API key) in a dialog.
async function showSnapshot(e, caption) {
  try {
    const blob = await (await api(served(e.snapshot))).blob();
    const image = $("#snapshot-image");
    if (image.src) URL.revokeObjectURL(image.src);
    image.src = URL.createObjectURL(blob);
    setText($("#snapshot-caption"), caption);
    $("#snapshot-dialog").showModal();
  } catch (err) {
    showError("snapshot", [`Snapshot of event ${e.id}: `, user(err.message)]);
  }
}

// An event's clip (GET /clips/{id}.mp4, fetched with the API key; the server answers once the
// seconds after the event are recorded) played in a dialog.
async function showClip(e, caption, what = `Clip of event ${e.id}`) {
  const status = $("#clip-caption");
  try {
    setText(status, [caption, " · loading the clip…"]);
    const blob = await (await api(served(e.clip))).blob();
    const video = $("#clip-video");
    if (video.src) URL.revokeObjectURL(video.src);
    video.src = URL.createObjectURL(blob);
    setText(status, caption);
    $("#clip-dialog").showModal();
  } catch (err) {
    showError("clip", [what, ": ", user(err.message)]);
  }
}

// "line 3" where "line 1" and "line 2" are taken: the lowest number no shape of the stream
// has (its count + 1 was taken again once a shape before the last was removed: a 422).
function freeName(word, shapes) {
  const taken = new Set(shapes.map((shape) => shape.name));
  let n = 1;
  while (taken.has(`${word} ${n}`)) n += 1;
  return `${word} ${n}`;
}

// The newest events first (GET /events?latest=true), then server-sent events from GET
// /events after them, so none falls between. The browser reconnects by itself after a network
// error and resumes after the last event it got (Last-Event-ID); a refusal (401, a server not
// ready) closes it, and it is opened again a little later, after the last event shown.
// While the tab is hidden it stays closed (pauseEvents).
async function connectEvents() {
  const generation = ++eventsGeneration;
  clearTimeout(eventRetry);
  eventSource?.close();
  eventSource = null;
  if (document.visibilityState === "hidden") return; // opened when the tab is shown
  const params = eventFilter();
  if (lastEventId === null) {
    try {
      const latest = new URLSearchParams(params);
      latest.set("latest", "true");
      latest.set("limit", String(EVENTS_SHOWN));
      const page = await (await api(`/events?${latest}`)).json();
      if (generation !== eventsGeneration) return; // overtaken: the newer one shows its own
      for (const e of page.events) showEvent(e);
      lastEventId = page.next;
      clearError("event-filter");
    } catch (err) {
      if (generation !== eventsGeneration) return;
      if (err.status === 422 || err.status === 404) {
        showError("event-filter", ["Event filter: ", user(err.message)]); // fixed in the form
        return;
      }
      eventRetry = setTimeout(connectEvents, EVENTS_RETRY_MS); // the error list says why
      return;
    }
  }
  if (generation !== eventsGeneration) return;
  eventSource?.close();
  params.set("after", String(lastEventId));
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) params.set("access_token", key);
  const source = new EventSource(`${BASE}/events?${params}`);
  eventSource = source;
  source.onopen = () => clearError("events");
  source.onmessage = (message) => {
    if (eventSource === source) showEvent(JSON.parse(message.data));
  };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED && eventSource === source) {
      eventRetry = setTimeout(connectEvents, EVENTS_RETRY_MS);
    }
  };
}

// An open EventSource holds one of the 6 connections Chromium (and Firefox) open to a server
// over HTTP/1.1, for as long as it is open: six tabs of the page held them all, a seventh
// never loaded and every call of the six waited. A hidden tab lets go of it, and opens it
// again when shown, after the last event it showed (events logged meanwhile come then; those
// the server's log no longer has are counted as missed). The page holds no other request
// open: tiles are WebSockets, which do not count against that limit, and nothing long-polls.
function pauseEvents() {
  ++eventsGeneration; // a first page still loading opens nothing
  clearTimeout(eventRetry);
  eventSource?.close();
  eventSource = null;
}

document.addEventListener("visibilitychange", () => {
  if (document.visibilityState === "hidden") pauseEvents();
  else connectEvents();
});

// The event list's filters (GET /events' query): a stream, a type, classes.
function eventFilter() {
  const params = new URLSearchParams();
  for (const [name, value] of new FormData($("#event-filter"))) {
    if (String(value).trim()) params.set(name, String(value).trim());
  }
  return params;
}

// A filter changed: the list starts again with the newest events that pass it.
function refilterEvents() {
  for (const image of $("#event-list").querySelectorAll("img.event-thumb")) {
    if (image.src) URL.revokeObjectURL(image.src);
  }
  $("#event-list").replaceChildren();
  $("#no-events").hidden = false;
  debug.events = [];
  lastEventId = null;
  connectEvents();
}

// The streams to filter on, kept in step with the stream list.
function updateEventStreams() {
  const select = $('#event-filter select[name="stream_id"]');
  const chosen = select.value;
  const options = [["", "every stream"]];
  for (const [id, stream] of streams) options.push([id, stream.name || id]);
  const now = options.map(([id, name]) => `${id}\u0000${name}`).join("\u0001");
  if (select.dataset.options === now) return;
  select.dataset.options = now;
  select.replaceChildren(...options.map(([id, name]) =>
    new Option(id ? isolated(name) : name, id, false, id === chosen)));
  if (select.value !== chosen) refilterEvents(); // the stream it showed is gone
}

// The events the filter passes, counted per hour, stream, type and class, as a CSV file.
async function downloadCounts() {
  const params = eventFilter();
  params.set("by", "stream_id,type,class_name");
  params.set("interval_s", "3600");
  params.set("format", "csv");
  try {
    const blob = await (await api(`/events/counts?${params}`)).blob();
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = "streamdet-event-counts.csv";
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
    clearError("event-filter");
  } catch (err) {
    showError("event-filter", ["Event counts: ", user(err.message)]);
  }
}

$("#event-filter").addEventListener("change", refilterEvents);
$("#event-filter").addEventListener("submit", (event) => {
  event.preventDefault(); // Enter in the classes box
  refilterEvents();
});
$("#event-counts").addEventListener("click", downloadCounts);

// ---------------------------------------------------------------- video jobs

const JOB_STATES_RUNNING = new Set(["queued", "running"]);
debug.jobs = [];

function jobProgress(job) {
  const p = job.progress;
  if (job.state === "queued") {
    return job.queue_position ? `waiting, ${job.queue_position} ahead` : "waiting";
  }
  const total = p.duration_s == null ? "" : ` of ${p.duration_s.toFixed(1)}`;
  const rate = p.fps == null ? "" : ` · ${p.fps.toFixed(1)} frames/s`;
  return `${p.position_s.toFixed(1)}${total} s · ${p.frames_processed} frames${rate}`;
}

// What a job found: its objects by class (each counted once where it tracked), and its lines'
// crossings; as parts.
function jobFound(job) {
  if (job.error) return [user(job.error)];
  const counts = job.counts;
  if (!counts) return [];
  const byClass = Object.keys(counts.tracked ?? {}).length ? counts.tracked : counts.detections;
  const parts = Object.entries(byClass ?? {}).map(([name, n]) => [user(name), ` ${n}`]);
  for (const [line, ways] of Object.entries(counts.crossings ?? {})) {
    const sum = (side) => Object.values(ways[side] ?? {}).reduce((a, b) => a + b, 0);
    parts.push([user(line), `: ${sum("in")} in, ${sum("out")} out`]);
  }
  return parts.length ? joinParts(parts, ", ") : ["nothing"];
}

function jobName(job) {
  return job.name || job.source.upload || job.source.url || job.id;
}

function renderJobs(list) {
  debug.jobs = list;
  $("#no-jobs").hidden = list.length > 0;
  $("#job-table").hidden = list.length === 0;
  const rows = list.map((job) => {
    const row = document.createElement("tr");
    row.dataset.id = job.id;
    const name = document.createElement("td");
    name.className = "job-name";
    name.textContent = jobName(job);
    const state = document.createElement("td");
    const badge = document.createElement("span");
    badge.className = "badge job-state";
    badge.dataset.state = job.state;
    badge.textContent = job.state;
    state.append(badge);
    const progress = document.createElement("td");
    const bar = document.createElement("progress");
    bar.max = 1;
    bar.value = job.state === "done" ? 1 : (job.progress.progress ?? 0);
    const text = document.createElement("span");
    text.className = "muted job-progress";
    text.textContent = jobProgress(job);
    progress.append(bar, " ", text);
    const found = document.createElement("td");
    found.className = "job-found";
    setText(found, jobFound(job));
    const actions = document.createElement("td");
    if (job.video_url && !JOB_STATES_RUNNING.has(job.state) && job.progress.frames_processed) {
      actions.append(eventButton("job-video", "Video", "The frames drawn, as a video", () =>
        showJobVideo(job)));
    }
    if (job.progress.frames_processed) {
      actions.append(eventButton("job-frames", "Frames", "Every frame's detections (NDJSON)", () =>
        downloadJob(job, job.frames_url, "frames.ndjson")));
    }
    const label = JOB_STATES_RUNNING.has(job.state) ? "Cancel" : "Delete";
    actions.append(eventButton("job-delete", label, `${label} this job and its files`, () =>
      deleteJob(job.id)));
    row.append(name, state, progress, found, actions);
    return row;
  });
  $("#job-rows").replaceChildren(...rows);
}

async function refreshJobs() {
  try {
    renderJobs((await (await api("/jobs?limit=20")).json()).jobs);
    clearError("jobs");
  } catch (err) {
    if (err.status !== 0) showError("jobs", ["Video jobs: ", user(err.message)]);
  }
}

async function addJob(event) {
  event.preventDefault();
  const form = event.target;
  const data = new FormData(form);
  const settings = {};
  const classes = String(data.get("classes") ?? "").trim();
  if (classes) settings.classes = classes;
  const fps = String(data.get("fps") ?? "").trim();
  if (fps) settings.fps = Number(fps);
  settings.track = data.get("track") === "on";
  settings.render = data.get("render") === "on";
  const body = new FormData();
  body.append("video", data.get("video"));
  body.append("settings", JSON.stringify(settings));
  const status = $("#job-upload");
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  status.textContent = "uploading…";
  try {
    await api("/jobs", { method: "POST", body });
    form.reset();
    clearError("add-job");
    status.textContent = "";
  } catch (err) {
    showError("add-job", ["Video job: ", user(err.message)]);
    status.textContent = "";
  } finally {
    button.disabled = false;
  }
  await refreshJobs();
}

async function deleteJob(id) {
  try {
    await api(`/jobs/${encodeURIComponent(id)}`, { method: "DELETE" });
  } catch (err) {
    showError("jobs", ["Video job ", user(id), ": ", user(err.message)]);
  }
  await refreshJobs();
}

async function downloadJob(job, path, suffix) {
  try {
    const blob = await (await api(served(path))).blob();
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = `${job.id}-${suffix}`;
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
  } catch (err) {
    showError("jobs", ["Video job ", user(job.id), ": ", user(err.message)]);
  }
}

// The job's drawn video, in the clip dialog.
async function showJobVideo(job) {
  const caption = [user(job.name || job.source.upload || job.id), " · ", jobFound(job)];
  await showClip({ id: job.id, clip: job.video_url }, caption, `Video of job ${job.id}`);
}

async function jobsLoop() {
  await refreshJobs();
  const busy = debug.jobs.some((job) => JOB_STATES_RUNNING.has(job.state));
  setTimeout(jobsLoop, busy ? 1000 : REFRESH_MS * 2);
}

$("#add-job").addEventListener("submit", addJob);

// ---------------------------------------------------------------- start

async function showModel() {
  try {
    const model = await (await api("/model")).json();
    setText($("#model-name"), [user(model.model), " · ", user(model.backend)]);
  } catch {
    // The status badge and the error list already say why.
  }
}

$("#add-stream").addEventListener("submit", addStream);
$("#view-fps").addEventListener("change", () => {
  for (const tile of tiles.values()) tile.reconnectNow();
});
$("#key-button").addEventListener("click", async () => {
  keyDeclined = false;
  if (await askForKey("API key for this server:")) {
    clearError("auth");
    for (const tile of tiles.values()) tile.reconnectNow();
    connectEvents();
    showModel();
    refreshStreams();
  }
});
setUpPlayground();
showModel().then(refreshLoop);
connectEvents();
jobsLoop();
