// Streams one chat completion through llm_proxy with the official openai
// npm client and prints one JSON line per chunk, for e2e/node_client_test.go.
//
// Usage: node stream.mjs <baseURL> [stream|expect-error] [headersJSON]
//
//   stream        print {"t_ms","delta","finish_reason","id"} per chunk, then
//                 {"done":true,"t_ms"}; exit 1 on any error.
//   expect-error  print {"error_class","api_error","status","message"} for
//                 the error the SDK throws; exit 1 if the stream succeeds.
//
// headersJSON is an object of extra request headers (X-Mock-* knobs).
// t_ms is milliseconds since the script started the request.
import OpenAI, { APIError } from 'openai';

const [baseURL, mode = 'stream', headersJSON = '{}'] = process.argv.slice(2);
if (!baseURL || !['stream', 'expect-error'].includes(mode)) {
  console.error('usage: node stream.mjs <baseURL> [stream|expect-error] [headersJSON]');
  process.exit(2);
}

const client = new OpenAI({
  baseURL: `${baseURL}/v1`,
  apiKey: 'sk-e2e-not-a-secret',
  maxRetries: 0, // the gateway does the failover; SDK retries would hide it
  timeout: 30_000,
  defaultHeaders: JSON.parse(headersJSON),
});

const out = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const t0 = performance.now();
const ms = () => Math.round((performance.now() - t0) * 10) / 10;

try {
  const stream = await client.chat.completions.create({
    model: 'mock-llama',
    messages: [{ role: 'user', content: 'Say hello from the openai npm client.' }],
    stream: true,
  });
  for await (const chunk of stream) {
    const choice = chunk.choices[0] ?? {};
    out({ t_ms: ms(), delta: choice.delta?.content ?? null, finish_reason: choice.finish_reason ?? null, id: chunk.id });
  }
  out({ done: true, t_ms: ms() });
  if (mode === 'expect-error') process.exitCode = 1;
} catch (err) {
  out({
    error_class: err?.constructor?.name ?? typeof err,
    api_error: err instanceof APIError,
    status: err?.status ?? null,
    message: String(err?.message ?? err),
  });
  process.exitCode = mode === 'expect-error' ? 0 : 1;
}
