// How the tests start the system Chromium (Debian's /usr/bin/chromium, or $CHROMIUM; playwright-core downloads no
// browser). playwright-core gives it a fresh temporary profile of its own (it refuses --user-data-dir in args).
export function chromiumArgs() {
  return {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  };
}
