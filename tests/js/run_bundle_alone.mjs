// node run_bundle_alone.mjs node|web JOBS.json
// JOBS.json: {"origin": "http://127.0.0.1:PORT" (web only), "jobs": [{"bundle", "batches", "out"}]}: each bundle
// trained on its batches by bundle_alone.mjs (the driver that knows bundle.json alone) on onnxruntime-node, or on
// onnxruntime-web (wasm) in headless Chromium (bundle and batches: paths under origin, onnxruntime-web at /ort/,
// this folder at /harness/); writes {"losses", "state"} (tensor_files.mjs) to out.
import { readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { chromiumArgs } from './chromium.mjs';

const [runtime, jobsFile] = process.argv.slice(2);
const { origin, jobs } = JSON.parse(await readFile(jobsFile, 'utf8'));

async function inNode(job) {
  const ort = await import('onnxruntime-node');
  const { trainAlone } = await import('./bundle_alone.mjs');
  const { readBatches, encodeState } = await import('./tensor_files.mjs');
  const { steps } = await readBatches(ort, async (f) => new Uint8Array(await readFile(join(job.batches, f))));
  const { losses, state } = await trainAlone(ort, async (f) => new Uint8Array(await readFile(join(job.bundle, f))),
    steps);
  return { losses, state: encodeState(state) };
}

async function inBrowser(page, job) {
  await page.goto(`${origin}/harness/blank.html`);
  return page.evaluate(async ({ bundle, batches }) => {
    const ort = await import('/ort/ort.wasm.min.mjs');
    ort.env.wasm.wasmPaths = '/ort/';
    const { trainAlone } = await import('/harness/bundle_alone.mjs');
    const { readBatches, encodeState } = await import('/harness/tensor_files.mjs');
    const reader = (folder) => async (f) => new Uint8Array(await (await fetch(`${folder}/${f}`)).arrayBuffer());
    const { steps } = await readBatches(ort, reader(batches));
    const { losses, state } = await trainAlone(ort, reader(bundle), steps, { executionProviders: ['wasm'] });
    return { losses, state: encodeState(state) };
  }, job);
}

if (runtime === 'web') {
  const { chromium } = await import('playwright-core');
  const browser = await chromium.launch(chromiumArgs());
  try {
    for (const job of jobs) {
      const page = await browser.newPage();
      const errors = [];
      page.on('pageerror', (e) => errors.push(String(e)));
      try {
        await writeFile(job.out, JSON.stringify(await inBrowser(page, job)));
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
  throw new Error(`usage: node run_bundle_alone.mjs node|web JOBS.json (got ${runtime})`);
}
