// The digits demo page: trains the bundle at /bundle/ on /data/ with train.js (WebGPU where the browser has an
// adapter, else wasm; the page shows which), draws the loss, and writes the test accuracy into #accuracy
// (data-accuracy, a fraction) and body[data-status] = done | error when it stops. ?ep=wasm: wasm only;
// ?epochs=N: N epochs instead of digits.json's.
import { train } from './train.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

async function runtime() {  // onnxruntime-web with WebGPU where the browser has an adapter (?ep=wasm forces wasm)
  const gpu = params.get('ep') !== 'wasm' && navigator.gpu && (await navigator.gpu.requestAdapter().catch(() => null));
  const ort = await import(gpu ? '/ort/ort.webgpu.min.mjs' : '/ort/ort.wasm.min.mjs');
  ort.env.wasm.wasmPaths = '/ort/';
  ort.env.logLevel = 'error';
  return { ort, backends: gpu ? ['webgpu', 'wasm'] : ['wasm'] };
}

async function load(file, Type) {
  const r = await fetch(`/data/${file}`);
  if (!r.ok) throw new Error(`/data/${file}: HTTP ${r.status}`);
  return new Type(await r.arrayBuffer());
}

function random(seed) {  // mulberry32: a seeded shuffle, the same every run
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function niceStep(range, count) {  // 1, 2 or 5 times a power of ten, about range / count
  const raw = range / count, power = 10 ** Math.floor(Math.log10(raw)), f = raw / power;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * power;
}

// The loss of each step (light) and each epoch's mean (dark) against the step, with a y axis ticked at round loss
// values and an x axis ticked at epoch ends; the ticks drawn are also in the canvas's data-y-ticks / data-x-ticks.
function draw(losses, epochMeans, perEpoch) {
  const c = $('chart'), g = c.getContext('2d');
  const [left, right, top, bottom] = [52, 14, 12, 40];
  const steps = Math.max(perEpoch * spec.epochs, 1);
  const dy = niceStep(Math.max(...losses.slice(0, 5), 0.1), 5);
  const yMax = Math.ceil(Math.max(...losses.slice(0, 5), 0.1) / dy) * dy;
  const x = (i) => left + (i / steps) * (c.width - left - right);
  const y = (v) => c.height - bottom - (Math.min(v, yMax) / yMax) * (c.height - top - bottom);
  g.clearRect(0, 0, c.width, c.height);
  g.font = '11px sans-serif';
  g.lineWidth = 1;
  const yTicks = [];
  for (let k = 0; k * dy <= yMax + dy / 1000; k++) yTicks.push(k * dy);
  const digits = Math.max(0, -Math.floor(Math.log10(dy)));
  g.textAlign = 'right'; g.textBaseline = 'middle';
  for (const v of yTicks) {
    g.strokeStyle = '#e6e6e6'; g.beginPath(); g.moveTo(left, y(v)); g.lineTo(c.width - right, y(v)); g.stroke();
    g.fillStyle = '#333'; g.fillText(v.toFixed(digits), left - 6, y(v));
  }
  const every = Math.ceil(spec.epochs / 12), xTicks = [];
  for (let e = 0; e <= spec.epochs; e += every) xTicks.push(e);
  g.textAlign = 'center'; g.textBaseline = 'top';
  for (const e of xTicks) {
    g.strokeStyle = '#333'; g.beginPath(); g.moveTo(x(e * perEpoch), c.height - bottom);
    g.lineTo(x(e * perEpoch), c.height - bottom + 4); g.stroke();
    g.fillText(String(e), x(e * perEpoch), c.height - bottom + 6);
  }
  g.strokeStyle = '#333'; g.beginPath(); g.moveTo(left, top); g.lineTo(left, c.height - bottom);
  g.lineTo(c.width - right, c.height - bottom); g.stroke();
  g.fillText(`epoch (${perEpoch} training steps each)`, (left + c.width - right) / 2, c.height - 16);
  g.save(); g.translate(12, (top + c.height - bottom) / 2); g.rotate(-Math.PI / 2);
  g.fillText('cross-entropy loss', 0, -6); g.restore();
  c.dataset.yTicks = yTicks.map((v) => v.toFixed(digits)).join(' ');
  c.dataset.xTicks = xTicks.join(' ');
  const lines = [[losses, '#9db4e8', 1, (i) => i], [epochMeans, '#143ca0', 2, (i) => (i + 1) * perEpoch]];
  for (const [series, color, width, at] of lines) {
    g.beginPath(); g.strokeStyle = color; g.lineWidth = width;
    series.forEach((v, i) => (i ? g.lineTo(x(at(i)), y(v)) : g.moveTo(x(at(i)), y(v))));
    g.stroke();
  }
}

let spec;
async function main() {
  spec = await (await fetch('/data/digits.json')).json();
  if (params.get('epochs')) spec.epochs = Number(params.get('epochs'));  // ?epochs=N: a shorter run
  const { ort, backends } = await runtime();
  let infer;  // the test-accuracy session, made on the backend the training got (one session at a time)
  const [xTrain, yTrain, xTest, yTest] = await Promise.all([load(spec.train.x, Float32Array),
    load(spec.train.y, BigInt64Array), load(spec.test.x, Float32Array), load(spec.test.y, BigInt64Array)]);
  const pixels = spec.image_shape.reduce((a, b) => a * b, 1), n = spec.train.n, bs = spec.batch_size;
  const perEpoch = Math.ceil(n / bs), total = perEpoch * spec.epochs;
  const testImages = new ort.Tensor('float32', xTest, [spec.test.n, ...spec.image_shape]);
  let state, epochLosses = [];
  const losses = [], epochMeans = [];

  async function accuracy() {
    const feeds = { image: testImages };
    for (const name of infer.inputNames) if (name !== 'image') feeds[name] = state[name];
    const logits = (await infer.run(feeds))[infer.outputNames[0]].data;
    let right = 0;
    for (let i = 0; i < spec.test.n; i++) {
      const row = logits.subarray(i * 10, i * 10 + 10);
      if (BigInt(row.indexOf(Math.max(...row))) === yTest[i]) right++;
    }
    return right / spec.test.n;
  }

  async function* batches() {
    const rand = random(spec.seed + 1), order = [...Array(n).keys()];
    for (let epoch = 1; epoch <= spec.epochs; epoch++) {
      for (let i = n - 1; i > 0; i--) {
        const j = Math.floor(rand() * (i + 1));
        [order[i], order[j]] = [order[j], order[i]];
      }
      for (let s = 0; s < n; s += bs) {
        const idx = order.slice(s, s + bs);
        const x = new Float32Array(idx.length * pixels), y = new BigInt64Array(idx.length);
        idx.forEach((k, r) => { x.set(xTrain.subarray(k * pixels, (k + 1) * pixels), r * pixels); y[r] = yTrain[k]; });
        yield { [spec.image]: new ort.Tensor('float32', x, [idx.length, ...spec.image_shape]),
          [spec.labels]: new ort.Tensor('int64', y, [idx.length]) };
      }
      epochMeans.push(epochLosses.reduce((a, b) => a + b, 0) / epochLosses.length); epochLosses = [];
      const acc = await accuracy();
      $('epoch').textContent = `${epoch}/${spec.epochs}`;
      $('accuracy').textContent = `${(100 * acc).toFixed(2)}%`;
      $('accuracy').dataset.accuracy = String(acc);
      draw(losses, epochMeans, perEpoch);
    }
  }

  document.body.dataset.status = 'training';
  $('status').textContent = 'training...';
  const t0 = performance.now();
  const cosine = (step) => 0.5 * spec.lr * (1 + Math.cos((Math.PI * step) / total));
  await train(ort, '/bundle/', batches(), {  // WebGPU first; where it fails, train.js goes on with wasm
    hyper: { learning_rate: cosine },
    backends,
    sessionOptions: { logSeverityLevel: 3 },  // errors only: not that a symbolic batch's shapes are the CPU's
    onOpen: async (bundle) => {
      const failed = bundle.tried.map((t) => ` (${t.backend} failed: ${t.error})`).join('');
      $('backend').textContent = `onnxruntime-web ${ort.env.versions?.web ?? ''}, ${bundle.backend}${failed}`;
      $('backend').dataset.backend = bundle.backend;
      await infer?.release();
      infer = await ort.InferenceSession.create('/model/infer.onnx', { executionProviders: [bundle.backend],
        logSeverityLevel: 3 });
    },
    onStep: async (step, loss, s) => {
      state = s; losses.push(loss); epochLosses.push(loss);
      $('step').textContent = `${step + 1}/${total}`; $('loss').textContent = loss.toFixed(4);
      if (step % 10 === 0) {  // redraw, and let the browser paint
        draw(losses, epochMeans, perEpoch);
        await new Promise((r) => setTimeout(r, 0));
      }
    },
  });
  $('status').textContent = `done: ${total} steps in ${((performance.now() - t0) / 1000).toFixed(1)} s.`;
  document.body.dataset.status = 'done';
}

main().catch((e) => {
  $('status').textContent = `error: ${e.message}`;
  document.body.dataset.error = e.message;
  document.body.dataset.status = 'error';
  throw e;
});
