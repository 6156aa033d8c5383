// Drives one request through llm_proxy (or straight at a mock replica) with
// an official SDK and prints one JSON line with what the SDK made of it,
// for e2e/sdk_test.go.
//
// Usage: node sdk.mjs <mode> <baseURL> [headersJSON] [optionsJSON]
//
// Modes:
//   anthropic-stream   @anthropic-ai/sdk messages.stream → finalMessage()
//   anthropic-create   @anthropic-ai/sdk messages.create (not streamed)
//   openai-responses   openai responses.create({stream: true}), raw events
//   openai-responses-helper  openai responses.stream() → finalResponse()
//   openai-chat        openai chat.completions.create({stream: true})
//   ai-responses       Vercel AI SDK streamText, @ai-sdk/openai .responses()
//   ai-chat            Vercel AI SDK streamText, @ai-sdk/openai .chat()
//
// optionsJSON: {"apiKey": "...", "maxTokens": N, "prompt": "..."}.
//
// Output (always one line, exit 0; exit 2 on bad arguments):
//   {"ok": true, "text", "stop_reason", "usage", "starts", "events", "error_events", "t_ms"}
//   {"ok": false, "error_class", "api_error", "status", "type", "code",
//    "body_type", "message", "text", "starts", "headers"}
// starts counts beginnings (message_start, response.created) the SDK saw;
// error_events counts in-band error events that the SDK yielded instead of
// throwing (openai-responses); text is what was streamed before an error.
// Each SDK is imported only by the modes that use it (startup time).

const [mode, baseURL, headersJSON = '{}', optionsJSON = '{}'] = process.argv.slice(2);
const modes = ['anthropic-stream', 'anthropic-create', 'openai-responses', 'openai-responses-helper', 'openai-chat', 'ai-responses', 'ai-chat'];
if (!modes.includes(mode) || !baseURL) {
  console.error(`usage: node sdk.mjs <${modes.join('|')}> <baseURL> [headersJSON] [optionsJSON]`);
  process.exit(2);
}
const headers = JSON.parse(headersJSON) ?? {};
const opts = JSON.parse(optionsJSON) ?? {};
const apiKey = opts.apiKey ?? 'sk-e2e-not-a-secret';
const maxTokens = opts.maxTokens ?? 256;
const prompt = opts.prompt ?? 'Say hello from the SDK.';
const model = 'mock-llama';
const t0 = performance.now();
const ms = () => Math.round((performance.now() - t0) * 10) / 10;

const state = { text: '', starts: 0, events: 0, error_events: 0 };

function headersOf(h) {
  if (!h) return null;
  const out = {};
  if (typeof h.forEach === 'function') h.forEach((v, k) => { out[k.toLowerCase()] = v; });
  else for (const [k, v] of Object.entries(h)) out[k.toLowerCase()] = v;
  return out;
}

let APIErrorClass = null; // the SDK's APIError, once imported

function failure(err) {
  const body = err?.error ?? null;
  return {
    ok: false,
    error_class: err?.constructor?.name ?? typeof err,
    api_error: APIErrorClass !== null && err instanceof APIErrorClass,
    code: err?.code ?? err?.data?.code ?? null,
    status: err?.status ?? err?.statusCode ?? null,
    type: err?.type ?? null,
    body_type: body?.error?.type ?? body?.type ?? null,
    message: String(err?.message ?? JSON.stringify(err)),
    headers: headersOf(err?.headers ?? err?.responseHeaders),
    text: state.text,
    starts: state.starts,
    events: state.events,
    t_ms: ms(),
  };
}

async function anthropic(stream) {
  const { default: Anthropic, APIError } = await import('@anthropic-ai/sdk');
  APIErrorClass = APIError;
  const client = new Anthropic({ baseURL, apiKey, maxRetries: 0, timeout: 30_000, defaultHeaders: headers });
  const params = { model, max_tokens: maxTokens, messages: [{ role: 'user', content: prompt }] };
  if (!stream) {
    const m = await client.messages.create(params);
    return { text: m.content.map((b) => b.text ?? '').join(''), stop_reason: m.stop_reason, usage: m.usage };
  }
  const s = client.messages.stream(params);
  s.on('streamEvent', (ev) => {
    state.events++;
    if (ev.type === 'message_start') state.starts++;
  });
  s.on('text', (delta) => { state.text += delta; });
  const m = await s.finalMessage();
  return { text: m.content.map((b) => b.text ?? '').join(''), stop_reason: m.stop_reason, usage: m.usage };
}

async function openaiClient() {
  const { default: OpenAI, APIError } = await import('openai');
  APIErrorClass = APIError;
  return new OpenAI({ baseURL: `${baseURL}/v1`, apiKey, maxRetries: 0, timeout: 30_000, defaultHeaders: headers });
}

async function openaiResponses() {
  const stream = await (await openaiClient()).responses.create({ model, input: prompt, max_output_tokens: maxTokens, stream: true });
  let last = null;
  for await (const ev of stream) {
    state.events++;
    if (ev.type === 'response.created') state.starts++;
    if (ev.type === 'response.output_text.delta') state.text += ev.delta;
    if (ev.type === 'error' || ev.type === 'response.failed') state.error_events++;
    last = ev;
  }
  const r = last?.response ?? {};
  return { text: state.text, stop_reason: last?.type ?? null, response_status: r.status ?? null, usage: r.usage ?? null };
}

async function openaiResponsesHelper() {
  const s = (await openaiClient()).responses.stream({ model, input: prompt, max_output_tokens: maxTokens });
  s.on('event', (ev) => {
    state.events++;
    if (ev.type === 'response.created') state.starts++;
  });
  s.on('response.output_text.delta', (ev) => { state.text += ev.delta; });
  const r = await s.finalResponse();
  return { text: r.output_text, stop_reason: r.status, response_status: r.status, usage: r.usage ?? null };
}

async function openaiChat() {
  const stream = await (await openaiClient()).chat.completions.create({
    model, messages: [{ role: 'user', content: prompt }], stream: true, stream_options: { include_usage: true },
  });
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    state.events++;
    const c = chunk.choices?.[0];
    if (c?.delta?.content) state.text += c.delta.content;
    if (c?.finish_reason) finish = c.finish_reason;
    if (chunk.usage) usage = chunk.usage;
  }
  return { text: state.text, stop_reason: finish, usage };
}

async function aiSDK(kind) {
  const { streamText } = await import('ai');
  const { createOpenAI } = await import('@ai-sdk/openai');
  const provider = createOpenAI({ baseURL: `${baseURL}/v1`, apiKey, headers });
  const result = streamText({
    model: kind === 'chat' ? provider.chat(model) : provider.responses(model),
    prompt,
    maxOutputTokens: maxTokens,
    maxRetries: 0,
    onError: () => {}, // errors come as 'error' parts below
  });
  let finish = null;
  let usage = null;
  for await (const part of result.fullStream) {
    state.events++;
    switch (part.type) {
      case 'start-step':
        state.starts++;
        break;
      case 'text-delta':
        state.text += part.text ?? part.textDelta ?? '';
        break;
      case 'finish':
        finish = part.finishReason;
        usage = part.totalUsage ?? part.usage ?? null;
        break;
      case 'error':
        throw part.error;
    }
  }
  return { text: state.text, stop_reason: finish, usage };
}

try {
  let r;
  switch (mode) {
    case 'anthropic-stream': r = await anthropic(true); break;
    case 'anthropic-create': r = await anthropic(false); break;
    case 'openai-responses': r = await openaiResponses(); break;
    case 'openai-responses-helper': r = await openaiResponsesHelper(); break;
    case 'openai-chat': r = await openaiChat(); break;
    case 'ai-responses': r = await aiSDK('responses'); break;
    case 'ai-chat': r = await aiSDK('chat'); break;
  }
  process.stdout.write(JSON.stringify({ ok: true, ...r, starts: state.starts, events: state.events, error_events: state.error_events, t_ms: ms() }) + '\n');
} catch (err) {
  process.stdout.write(JSON.stringify(failure(err)) + '\n');
}
