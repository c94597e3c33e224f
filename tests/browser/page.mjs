// Drives the coordinator's page in headless Chromium (Playwright): the
// key prompt, the cluster view (a pipeline and a second worker), a
// streamed completion, then a killed worker leaving the view.
//
// Usage: node page.mjs <page url> <api key> <screenshot dir>
// Talks to its caller on stdio: prints "kill <name>" and waits for a line
// on stdin once the worker is killed; prints "ok" at the end.
import { createRequire } from "node:module";
import { createInterface } from "node:readline";

// playwright-core from where .ci/run installed it (TINYVLLM_TEST_BROWSER).
const require = createRequire(process.env.TINYVLLM_TEST_BROWSER + "/node_modules/");
const { chromium } = require("playwright-core");

const [url, key, shots] = process.argv.slice(2);
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const fail = (why) => {
  console.error("FAIL: " + why);
  process.exit(1);
};

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
try {
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  await page.goto(url);

  // The API needs the key: the page says so until it is given.
  await page.waitForFunction(() => document.getElementById("cluster-error").textContent.includes("API key"));
  await page.fill("#api-key", key);
  await page.dispatchEvent("#api-key", "change");

  // Both workers, one of them a pipeline of two stages with its layer ranges.
  await page.waitForFunction(() => document.querySelectorAll("#workers tbody tr").length === 2, null, { timeout: 20000 });
  const table = await page.textContent("#workers");
  if (!table.includes("pipeline of 2 stages")) fail("no pipeline in the cluster view: " + table);
  if (!/layers 0-\d/.test(table)) fail("no layer ranges: " + table);
  if (!table.includes("extra")) fail("the second worker is missing: " + table);
  if (!table.includes("joined by local") || !table.includes("joined by address")) fail("how workers joined: " + table);
  await page.waitForFunction(() => document.getElementById("model").textContent.includes("stories260K"));

  // The built-in model has no chat template: the playground continues text.
  await page.waitForFunction(() => document.getElementById("mode").value === "completion");
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "200");
  await page.evaluate(() => {
    window.updates = 0;
    new MutationObserver(() => window.updates++).observe(document.getElementById("transcript"),
      { childList: true, characterData: true, subtree: true });
  });
  await page.fill("#prompt", "Once upon a time");
  await page.click("#send");
  await page.waitForFunction(() => {
    const turns = document.querySelectorAll(".turn.assistant .meta");
    return turns.length > 0 && turns[turns.length - 1].textContent.includes("finish");
  }, null, { timeout: 60000 });
  const story = await page.textContent(".turn.assistant .text");
  if (!story.startsWith(", there was a little girl named Lily")) fail("unexpected story: " + story);
  const updates = await page.evaluate(() => window.updates);
  if (updates < 10) fail("the reply did not stream (" + updates + " updates)");
  await page.screenshot({ path: shots + "/page-chat-and-cluster.png", fullPage: true });

  // A killed worker leaves the view.
  console.log("kill extra");
  await lines.next();
  await page.waitForFunction(() => !document.getElementById("workers").textContent.includes("extra"), null, { timeout: 30000 });
  await page.waitForFunction(() => (document.getElementById("events") || {}).textContent?.includes("left"), null, { timeout: 10000 });
  await page.screenshot({ path: shots + "/page-worker-left.png", fullPage: true });
  if (errors.length) fail("page errors: " + errors.join("; "));
  console.log("ok");
} catch (err) {
  // What the page showed, for the test's message, and a screenshot of it.
  await page.screenshot({ path: shots + "/page-failure.png", fullPage: true }).catch(() => {});
  const shown = await page.evaluate(() => ({
    status: document.getElementById("status").textContent,
    transcript: document.getElementById("transcript").innerText,
    cluster: document.getElementById("cluster").innerText,
  })).catch(() => ({}));
  fail(err.message + "\npage: " + JSON.stringify(shown));
} finally {
  await browser.close();
}
process.exit(0); // stdin stays open: end here
