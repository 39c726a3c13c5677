// node web_demo.mjs URL [TIMEOUT_S] [webgpu]: open the `onnx-autodiff demo --web` page in headless Chromium, wait
// until it has trained (body[data-status] done or error) and print {"status", "accuracy", "backend", "error",
// the chart's ticks, ...}.
// webgpu: give the page a WebGPU adapter (SwiftShader's software Vulkan; no GPU needed).
import { chromium } from 'playwright-core';
import { chromiumArgs } from './chromium.mjs';

const [url, timeout = '300', webgpu] = process.argv.slice(2);
const browser = await chromium.launch(chromiumArgs({ webgpu: webgpu === 'webgpu' }));
try {
  const page = await browser.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  page.on('console', (m) => m.type() === 'error' && errors.push(m.text()));
  await page.goto(url);
  await page.waitForSelector('body[data-status="done"], body[data-status="error"]', { timeout: Number(timeout) * 1000 });
  const result = await page.evaluate(() => ({
    status: document.body.dataset.status, error: document.body.dataset.error ?? null,
    accuracy: Number(document.getElementById('accuracy').dataset.accuracy),
    backend: document.getElementById('backend').textContent, steps: document.getElementById('step').textContent,
    summary: document.getElementById('status').textContent,
    yTicks: document.getElementById('chart').dataset.yTicks ?? '',
    xTicks: document.getElementById('chart').dataset.xTicks ?? '',
  }));
  console.log(JSON.stringify({ ...result, pageErrors: errors }));
} finally {
  await browser.close();
}
