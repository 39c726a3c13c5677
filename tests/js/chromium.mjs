// How the tests start the system Chromium (Debian's /usr/bin/chromium, or $CHROMIUM; playwright-core downloads no
// browser). playwright-core gives it a fresh temporary profile of its own (it refuses --user-data-dir in args).
// webgpu: give the pages a WebGPU adapter (SwiftShader's software Vulkan: no GPU needed).
export function chromiumArgs({ webgpu = false } = {}) {
  const args = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'];
  return {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: webgpu ? args.filter((a) => a !== '--disable-gpu').concat(['--enable-unsafe-webgpu',
      '--enable-features=Vulkan', '--use-webgpu-adapter=swiftshader', '--use-angle=swiftshader']) : args,
  };
}
