// node run_bundles.mjs node|web|webgpu JOBS.json
// JOBS.json: {"origin": "http://127.0.0.1:PORT" (web only), "jobs": [{"bundle", "batches", "out", "strict"}]}.
// node: bundle and batches are directories; web: paths under origin, trained in headless Chromium with
// onnxruntime-web (wasm) served at /ort/, train.js at /web/, this folder at /harness/; webgpu: the same with
// onnxruntime-web's WebGPU EP on SwiftShader's software adapter, nothing else (no wasm to fall back on; "strict":
// the CPU fallback off too, every node on the GPU). Each job trains its bundle on its batches with
// onnx_autodiff/web/train.js and writes {"losses", "state", "backend"} (tensor_files.mjs) to out.
import { readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { chromiumArgs } from './chromium.mjs';

const [runtime, jobsFile] = process.argv.slice(2);
const { origin, jobs } = JSON.parse(await readFile(jobsFile, 'utf8'));

async function inNode(job) {
  const ort = await import('onnxruntime-node');
  const { train } = await import('../../onnx_autodiff/web/train.js');
  const { readBatches, encodeState } = await import('./tensor_files.mjs');
  const { steps, hyper } = await readBatches(ort, async (f) => new Uint8Array(await readFile(join(job.batches, f))));
  const { state, losses } = await train(ort, job.bundle, steps, { hyper });
  return { losses, state: encodeState(state) };
}

async function inBrowser(page, job, webgpu) {
  await page.goto(`${origin}/harness/blank.html`);
  return page.evaluate(async ({ bundle, batches, strict, webgpu }) => {
    const ort = await import(webgpu ? '/ort/ort.webgpu.min.mjs' : '/ort/ort.wasm.min.mjs');
    ort.env.wasm.wasmPaths = '/ort/';
    const { train } = await import('/web/train.js');
    const { readBatches, encodeState } = await import('/harness/tensor_files.mjs');
    const read = async (f) => new Uint8Array(await (await fetch(`${batches}/${f}`)).arrayBuffer());
    const { steps, hyper } = await readBatches(ort, read);
    const sessionOptions = strict ? { extra: { session: { disable_cpu_ep_fallback: '1' } } } : {};
    const { state, losses, bundle: b } = await train(ort, bundle, steps, { hyper, sessionOptions, initOptions: {},
      backends: [webgpu ? 'webgpu' : 'wasm'] });
    return { losses, state: encodeState(state), backend: b.backend };
  }, { ...job, webgpu });
}

if (runtime === 'web' || runtime === 'webgpu') {
  const { chromium } = await import('playwright-core');
  const browser = await chromium.launch(chromiumArgs({ webgpu: runtime === 'webgpu' }));
  try {
    for (const job of jobs) {
      const page = await browser.newPage();
      const errors = [];
      page.on('pageerror', (e) => errors.push(String(e)));
      try {
        await writeFile(job.out, JSON.stringify(await inBrowser(page, job, runtime === 'webgpu')));
      } catch (e) {
        throw new Error(`${job.bundle} in Chromium: ${e.message}${errors.length ? `\npage errors: ${errors.join('\n')}` : ''}`);
      }
      await page.close();
    }
  } finally {
    await browser.close();
  }
} else if (runtime === 'node') {
  for (const job of jobs) await writeFile(job.out, JSON.stringify(await inNode(job)));
} else {
  throw new Error(`usage: node run_bundles.mjs node|web|webgpu JOBS.json (got ${runtime})`);
}
