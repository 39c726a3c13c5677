// Train an onnx-autodiff step bundle (bundle.json + step.onnx + init.onnx) with onnxruntime-web or
// onnxruntime-node: pass the `ort` namespace you imported. docs/runtimes.md describes the bundle format.
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

export async function openBundle(ort, where, { sessionOptions } = {}) {
  const at = (f) => resolve(where, f);
  const src = await source(await at('bundle.json'));
  const text = typeof src === 'string' ? await (await import('node:fs/promises')).readFile(src, 'utf8')
    : new TextDecoder().decode(src);
  const spec = JSON.parse(text);
  if (spec.format !== 'onnx-autodiff-step/1') {
    throw new Error(`onnx-autodiff bundle: ${where}/bundle.json has format ${JSON.stringify(spec.format)}; ` +
      'this driver reads onnx-autodiff-step/1');
  }
  for (const key of ['step', 'init']) {  // a bundle from a stranger names files in its own folder only
    const f = spec[key];
    if (typeof f !== 'string' || /^([a-z][a-z0-9+.-]*:|[\\/])/i.test(f) || f.split(/[\\/]/).includes('..')) {
      throw new Error(`onnx-autodiff bundle: bundle.json's ${key} is ${JSON.stringify(f)}, a file outside the ` +
        'bundle\'s folder; a bundle names only files beside bundle.json');
    }
  }
  const open = async (f) => ort.InferenceSession.create(await source(await at(f)), sessionOptions);
  const [step, init] = await Promise.all([open(spec.step), open(spec.init)]);
  const feeds = spec.feeds.map((f) => (typeof f === 'string' ? f : f.name));
  const roles = { state: Object.keys(spec.state), feed: feeds, 'hyper-parameter': Object.keys(spec.hyper) };
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
  return { spec, step, init, feeds, scalar };
}

const same = (a, b) => a.data.length === b.data.length && a.data.every((x, i) => x === b.data[i]);

// One step: returns { loss (a number), state (the new state, keyed like bundle.json's state inputs) }.
export async function runStep(bundle, state, batch, hyper = {}, stepNumber = 0) {
  const { spec, step, scalar } = bundle;
  const values = {};
  for (const [name, v] of Object.entries({ ...spec.hyper, ...hyper })) {
    values[name] = typeof v === 'function' ? v(stepNumber) : v;
  }
  const feeds = { ...batch, ...state };
  for (const [name, v] of Object.entries(values)) feeds[name] = typeof v === 'number' ? scalar(name, v) : v;
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
// state)` may be async. Returns { state, losses, bundle }; pass `state` to continue from a trained state.
export async function train(ort, where, batches, { hyper = {}, state, sessionOptions, onStep } = {}) {
  const bundle = await openBundle(ort, where, { sessionOptions });
  if (!state) state = await bundle.init.run({}, Object.keys(bundle.spec.state));
  const losses = [];
  for await (const batch of batches) {
    const r = await runStep(bundle, state, batch, hyper, losses.length);
    state = r.state;
    losses.push(r.loss);
    if (onStep) await onStep(losses.length - 1, r.loss, state);
  }
  return { state, losses, bundle };
}
