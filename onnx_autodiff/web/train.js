// Train an onnx-autodiff step bundle (bundle.json + step.onnx + init.onnx) with onnxruntime-web or
// onnxruntime-node: pass the `ort` namespace you imported. docs/runtimes.md describes the bundle format; it tries
// WebGPU first where the page has it (import onnxruntime-web's webgpu bundle), then wasm, and says which it got.
const isNode = typeof process !== 'undefined' && !!process.versions?.node;

async function resolve(where, file) {  // a URL (http:, file:) or, in Node, a directory path
  const folder = where.endsWith('/') ? where : `${where}/`;
  if (/^[a-z][a-z0-9+.-]*:/i.test(where)) return new URL(file, folder);
  if (!isNode) return new URL(file, new URL(folder, globalThis.location.href));
  const { pathToFileURL } = await import('node:url');
  return pathToFileURL((await import('node:path')).resolve(where, file));
}

async function source(url) {  // for InferenceSession.create: a path in Node (external data works), else bytes
  if (url.protocol === 'file:') return (await import('node:url')).fileURLToPath(url);
  const r = await fetch(url);
  if (!r.ok) throw new Error(`onnx-autodiff bundle: ${url} answered HTTP ${r.status}`);
  return new Uint8Array(await r.arrayBuffer());
}

// The execution providers openBundle tries, in order: WebGPU where the runtime has it (onnxruntime-web's webgpu
// bundle in a browser with navigator.gpu), then wasm (onnxruntime-web) or cpu (onnxruntime-node).
export function defaultBackends(ort) {
  const web = !isNode;
  const gpu = web && typeof navigator !== 'undefined' && !!navigator.gpu && !!ort.env?.webgpu;
  return [...(gpu ? ['webgpu'] : []), web ? 'wasm' : 'cpu'];
}

// The caller's options on one backend. (onnxruntime-web 1.30 has no way to pass the WebGPU EP's enableInt64: a
// bundle for the webgpu target has no int64 arithmetic, docs/gpu.md.)
function optionsFor(backend, sessionOptions = {}) {
  return { ...sessionOptions, executionProviders: [backend] };
}

// Opens init.onnx, then step.onnx: one session at a time (onnxruntime-web's WebGPU EP refuses to make a session while
// it makes another). `backends`: the execution providers to try in order (default: defaultBackends(ort));
// `sessionOptions.executionProviders`, if given, is tried as one backend. `initOptions`: other options for init.onnx,
// which runs once (e.g. without the step's `disable_cpu_ep_fallback`: it copies the int64 step counter, which
// WebGPU leaves to the CPU). The bundle says which backend it got (`backend`) and why the ones before failed (`tried`).
export async function openBundle(ort, where, { sessionOptions, initOptions, backends } = {}) {
  const at = (f) => resolve(where, f);
  const src = await source(await at('bundle.json'));
  const text = typeof src === 'string' ? await (await import('node:fs/promises')).readFile(src, 'utf8')
    : new TextDecoder().decode(src);
  const spec = JSON.parse(text);
  if (!['onnx-autodiff-step/2', 'onnx-autodiff-step/1'].includes(spec.format)) {  // /1: no host scalars
    throw new Error(`onnx-autodiff bundle: ${where}/bundle.json has format ${JSON.stringify(spec.format)}; ` +
      'this driver reads onnx-autodiff-step/2 and /1');
  }
  for (const key of ['step', 'init']) {  // a bundle from a stranger names files in its own folder only
    const f = spec[key];
    if (typeof f !== 'string' || /^([a-z][a-z0-9+.-]*:|[\\/])/i.test(f) || f.split(/[\\/]/).includes('..')) {
      throw new Error(`onnx-autodiff bundle: bundle.json's ${key} is ${JSON.stringify(f)}, a file outside the ` +
        'bundle\'s folder; a bundle names only files beside bundle.json');
    }
  }
  const models = { init: await source(await at(spec.init)), step: await source(await at(spec.step)) };
  const given = sessionOptions?.executionProviders;
  const order = backends ?? (given ? [given] : defaultBackends(ort));
  const tried = [];
  let step, init, backend;
  for (const b of order) {
    const made = (o) => (Array.isArray(b) ? { ...o, executionProviders: b } : optionsFor(b, o));
    const options = made(sessionOptions);
    try {
      init = await ort.InferenceSession.create(models.init, initOptions ? made(initOptions) : options);
      step = await ort.InferenceSession.create(models.step, options);
      backend = Array.isArray(b) ? b.map((e) => (typeof e === 'string' ? e : e.name)).join(',') : b;
      break;
    } catch (e) {
      await init?.release?.();
      init = undefined;
      tried.push({ backend: String(b), error: e.message.split('\n')[0].slice(0, 300) });
    }
  }
  if (!step) {
    throw new Error(`onnx-autodiff bundle: no backend could open ${where}: ` +
      tried.map((t) => `${t.backend}: ${t.error}`).join('; '));
  }
  const feeds = spec.feeds.map((f) => (typeof f === 'string' ? f : f.name));
  const hostScalars = spec.host_scalars ?? {};
  const roles = { state: Object.keys(spec.state), feed: feeds, 'hyper-parameter': Object.keys(spec.hyper),
    'host scalar': Object.keys(hostScalars) };
  for (const [role, names] of Object.entries(roles)) {
    const missing = names.filter((n) => !step.inputNames.includes(n));
    if (missing.length) {
      throw new Error(`onnx-autodiff bundle: ${role} input(s) ${missing.join(', ')} of bundle.json are not among ` +
        `the step session's inputNames (${step.inputNames.join(', ')}); a runtime ignores what it does not list, so ` +
        'training would be silently wrong. Re-export the bundle with `onnx-autodiff export-step` (no input may ' +
        'carry an initializer default).');
    }
  }
  const noInit = Object.keys(spec.state).filter((n) => !init.outputNames.includes(n));
  if (noInit.length) throw new Error(`onnx-autodiff bundle: init.onnx has no output(s) ${noInit.join(', ')}`);
  const meta = Object.fromEntries((step.inputMetadata ?? []).map((m) => [m.name, m]));
  const arrays = { float32: Float32Array, float64: Float64Array, int32: Int32Array, int64: BigInt64Array };
  const scalar = (name, v) => {  // a hyper-parameter as the step input's type (float32 where the runtime can't say)
    const type = meta[name]?.type in arrays ? meta[name].type : 'float32';
    const dims = (meta[name]?.shape ?? []).map(() => 1);
    return new ort.Tensor(type, arrays[type].of(type === 'int64' ? BigInt(v) : v), dims);
  };
  const release = async () => { await step.release?.(); await init.release?.(); };
  return { spec, step, init, feeds, scalar, backend, tried, release, ort, options: { sessionOptions, initOptions, order } };
}

// A host scalar of bundle.json for the state's step counter: with t = counter + offset, the product over
// [beta, power] of (1 - beta^t)^power (Adam's bias corrections), computed in float64 (JavaScript numbers), or t
// itself where there are no factors (the counter's next value); as an array of its dtype.
export function hostScalar(spec, counter) {
  const t = counter + spec.offset;
  if (!spec.factors) return spec.dtype === 'int64' ? BigInt64Array.of(BigInt(t)) : Int32Array.of(t);
  const value = spec.factors.reduce((v, [beta, power]) => v * (1 - beta ** t) ** power, 1);
  return spec.dtype === 'float64' ? Float64Array.of(value) : Float32Array.of(value);
}

const TYPED = { float32: Float32Array, float16: Uint16Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array };

// bundle.json's `made` (a decoder's empty KV cache, cache switches, positions from the mask): the batch with each
// one it does not give, as TrainingSession makes them (docs/runtimes.md, "made").
export function madeFeeds(ort, made, batch) {
  if (!made) return batch;
  const out = { ...batch };
  const need = (name) => {
    if (!batch[name]) throw new Error(`onnx-autodiff bundle: ${name} is made from the batch's ${name}, which is missing`);
    return batch[name];
  };
  for (const c of made.caches ?? []) {
    if (c.name in out) continue;
    if (c.window_node && batch.attention_mask && Array.from(batch.attention_mask.data).some((v) => Number(v) === 0)) {
      throw new Error(`onnx-autodiff bundle: attention_mask masks tokens, but node ${c.window_node} keeps a ` +
        'window-sized KV cache, which onnxruntime runs over whole rows only: train on rows without padding');
    }
    const dims = c.dims.map((d) => (Array.isArray(d) ? need(d[0]).dims[d[1]] : d));
    out[c.name] = new ort.Tensor(c.dtype, new TYPED[c.dtype](dims.reduce((a, b) => a * b, 1)), dims);
  }
  for (const name of made.switches ?? []) if (!(name in out)) out[name] = new ort.Tensor('bool', Uint8Array.of(0), [1]);
  const p = made.positions;
  if (p && !(p.name in out)) {
    const mask = batch[p.mask];
    const [b, len] = (mask ?? need(p.tokens)).dims;
    const values = new Array(b * len);
    for (let r = 0; r < b; r += 1) {
      let seen = 0;
      for (let i = 0; i < len; i += 1) {
        const on = mask ? Number(mask.data[r * len + i]) !== 0 : true;
        seen += on ? 1 : 0;
        values[r * len + i] = on ? seen - 1 : 1;
      }
    }
    const data = p.dtype === 'int64' ? BigInt64Array.from(values, BigInt) : Int32Array.from(values);
    out[p.name] = new ort.Tensor(p.dtype, data, [b, len]);
  }
  return out;
}

const same = (a, b) => a.data.length === b.data.length && a.data.every((x, i) => x === b.data[i]);

// One step: returns { loss (a number), state (the new state, keyed like bundle.json's state inputs) }.
export async function runStep(bundle, state, batch, hyper = {}, stepNumber = 0) {
  const { spec, step, scalar } = bundle;
  const values = {};
  for (const [name, v] of Object.entries({ ...spec.hyper, ...hyper })) {
    values[name] = typeof v === 'function' ? v(stepNumber) : v;
  }
  const feeds = { ...madeFeeds(bundle.ort, spec.made, batch), ...state };
  for (const [name, v] of Object.entries(values)) feeds[name] = typeof v === 'number' ? scalar(name, v) : v;
  for (const [name, h] of Object.entries(spec.host_scalars ?? {})) {
    const counter = state[h.counter];
    if (!counter) throw new Error(`onnx-autodiff bundle: host scalar ${name} counts on ${h.counter}, no state tensor`);
    feeds[name] = new bundle.ort.Tensor(h.dtype, hostScalar(h, Number(counter.data[0])), []);
  }
  const unfed = step.inputNames.filter((n) => !(n in feeds));
  if (unfed.length) throw new Error(`onnx-autodiff bundle: nothing fed for step input(s) ${unfed.join(', ')}`);
  const unknown = Object.keys(feeds).filter((n) => !step.inputNames.includes(n));
  if (unknown.length) {
    throw new Error(`onnx-autodiff bundle: ${unknown.join(', ')} fed, but the step takes no such input ` +
      `(its inputNames: ${step.inputNames.join(', ')})`);
  }
  const out = await step.run(feeds, [...new Set([spec.loss, ...Object.values(spec.state)])]);
  const next = Object.fromEntries(Object.entries(spec.state).map(([i, o]) => [i, out[o]]));
  const lr = values.learning_rate;
  const moving = lr === undefined || Number(lr?.data?.[0] ?? lr) !== 0;
  if (moving && Object.keys(next).every((k) => same(next[k], state[k]))) {
    throw new Error(`onnx-autodiff bundle: step ${stepNumber} came back with every state tensor equal to what was ` +
      'fed, at a nonzero learning rate: the runtime ignored the fed state (an input with an initializer default?)');
  }
  return { loss: Number(out[spec.loss].data[0]), state: next };
}

// Train over `batches` (an iterable or async iterable of {feed name: ort.Tensor}). `hyper` values are numbers,
// tensors or functions of the step number (0, 1, ...) such as a learning-rate schedule. `onStep(step, loss,
// state)` and `onOpen(bundle)` (sessions open: bundle.backend says on what) may be async. `backends`: as openBundle's; a backend whose sessions open but whose first step fails
// (a kernel that refuses at run time) gives way to the next one, from the same state. Returns { state, losses,
// bundle } (bundle.backend: where it trained); pass `state` to continue from a trained state.
export async function train(ort, where, batches, { hyper = {}, state, sessionOptions, initOptions, onStep, onOpen,
  backends } = {}) {
  let bundle = await openBundle(ort, where, { sessionOptions, initOptions, backends });
  if (onOpen) await onOpen(bundle);
  const given = state;
  if (!state) state = await bundle.init.run({}, Object.keys(bundle.spec.state));
  const losses = [];
  for await (const batch of batches) {
    let r;
    try {
      r = await runStep(bundle, state, batch, hyper, losses.length);
    } catch (e) {
      const rest = bundle.options.order.slice(bundle.options.order.indexOf(bundle.backend) + 1);
      if (losses.length || !rest.length || !bundle.options.order.includes(bundle.backend)) throw e;
      const failed = { backend: bundle.backend, error: e.message.split('\n')[0].slice(0, 300) };
      await bundle.release();
      bundle = await openBundle(ort, where, { sessionOptions, initOptions, backends: rest });
      bundle.tried.unshift(failed);
      if (onOpen) await onOpen(bundle);
      state = given ?? await bundle.init.run({}, Object.keys(bundle.spec.state));
      r = await runStep(bundle, state, batch, hyper, 0);
    }
    state = r.state;
    losses.push(r.loss);
    if (onStep) await onStep(losses.length - 1, r.loss, state);
  }
  return { state, losses, bundle };
}
