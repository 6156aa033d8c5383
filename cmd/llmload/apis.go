package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
)

// The APIs llmload can drive (--api), as mockllm and vLLM serve them.
const (
	APIChat        = "chat"        // POST /v1/chat/completions
	APICompletions = "completions" // POST /v1/completions
	APIResponses   = "responses"   // POST /v1/responses (OpenAI Responses)
	APIMessages    = "messages"    // POST /v1/messages (Anthropic Messages)
)

// apiPaths maps each API to its request path.
var apiPaths = map[string]string{
	APIChat:        "/v1/chat/completions",
	APICompletions: "/v1/completions",
	APIResponses:   "/v1/responses",
	APIMessages:    "/v1/messages",
}

// validAPI reports whether api is one llmload drives ("" is chat).
func validAPI(api string) bool { _, ok := apiPaths[api]; return ok || api == "" }

// apiBody builds a request body of the API: the same prompt (padded to
// promptBytes) as chatBody, in the API's fields; maxTokens (0: omitted)
// goes into max_tokens, max_output_tokens (Responses) or Messages'
// max_tokens, which that API requires (1024 when 0).
func apiBody(api, model string, stream bool, maxTokens, promptBytes int) []byte {
	if api == "" || api == APIChat {
		return chatBody(model, stream, maxTokens, promptBytes)
	}
	var req map[string]any
	_ = json.Unmarshal(chatBody(model, stream, 0, promptBytes), &req)
	msgs := req["messages"]
	switch api {
	case APICompletions:
		delete(req, "messages")
		req["prompt"] = msgs.([]any)[0].(map[string]any)["content"]
		if maxTokens > 0 {
			req["max_tokens"] = maxTokens
		}
	case APIResponses:
		delete(req, "messages")
		req["input"] = msgs
		if maxTokens > 0 {
			req["max_output_tokens"] = maxTokens
		}
	case APIMessages:
		if maxTokens <= 0 {
			maxTokens = 1024
		}
		req["max_tokens"] = maxTokens
	}
	out, _ := json.Marshal(req)
	return out
}

// eventKind is what an event of a Responses or Messages stream is to a
// client measuring it.
type eventKind int

const (
	eventLifecycle eventKind = iota // carries nothing generated (response.created, message_start, ping, …)
	eventGenerated                  // text, reasoning or a tool call: the first one is the TTFT
	eventEnd                        // the stream's normal end
	eventError                      // an in-band error
)

// classifyEvent classifies one event of a Responses or Messages stream by
// its event name (or, without one, its data's "type"); finish is the stop
// reason or status it carries, msg an error's message.
func classifyEvent(api, name string, data []byte) (k eventKind, finish, msg string) {
	var v struct {
		Type     string `json:"type"`
		Message  string `json:"message"`
		Code     any    `json:"code"`
		Response struct {
			Status string `json:"status"`
			Error  *struct {
				Code    any    `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		} `json:"response"`
		Error *struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
		ContentBlock struct {
			Type string `json:"type"`
		} `json:"content_block"`
		Delta struct {
			StopReason *string `json:"stop_reason"`
		} `json:"delta"`
	}
	_ = json.Unmarshal(data, &v)
	if name == "" {
		name = v.Type
	}
	if name == "error" || name == "response.failed" || (v.Error != nil && v.Error.Message != "" && name != "response.completed") {
		switch {
		case v.Error != nil:
			return eventError, "", fmt.Sprintf("%s (%s)", v.Error.Message, v.Error.Type)
		case v.Response.Error != nil:
			return eventError, "", fmt.Sprintf("%s (code %v)", v.Response.Error.Message, v.Response.Error.Code)
		}
		return eventError, "", fmt.Sprintf("%s (code %v)", v.Message, v.Code)
	}
	switch api {
	case APIResponses:
		switch {
		case name == "response.completed" || name == "response.incomplete":
			return eventEnd, v.Response.Status, ""
		case strings.HasSuffix(name, ".delta"):
			return eventGenerated, "", ""
		}
	case APIMessages:
		switch name {
		case "message_stop":
			return eventEnd, "", ""
		case "content_block_delta":
			return eventGenerated, "", ""
		case "content_block_start":
			if v.ContentBlock.Type != "text" && v.ContentBlock.Type != "thinking" {
				return eventGenerated, "", "" // a tool_use block
			}
		case "message_delta":
			if v.Delta.StopReason != nil {
				return eventLifecycle, *v.Delta.StopReason, ""
			}
		}
	}
	return eventLifecycle, "", ""
}

// jsonFinish reads a non-streaming body of the API: its stop reason
// (finish_reason, Responses' status, Messages' stop_reason), "" when it
// has none.
func jsonFinish(api string, b []byte) (string, error) {
	var c struct {
		Choices []struct {
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
		Status     string  `json:"status"`
		StopReason *string `json:"stop_reason"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return "", err
	}
	switch api {
	case APIResponses:
		if c.Status == "completed" || c.Status == "incomplete" {
			return c.Status, nil
		}
		return "", nil
	case APIMessages:
		if c.StopReason != nil {
			return *c.StopReason, nil
		}
		return "", nil
	}
	finish := ""
	for _, ch := range c.Choices {
		if ch.FinishReason != nil && *ch.FinishReason != "" {
			finish = *ch.FinishReason
		}
	}
	return finish, nil
}

// tableCmd prints one row per run report (llmload run --json): label,
// API, requests, ok, failures by outcome, TTFT p50/p99.
func tableCmd(args []string) error {
	fs := newFlagSet("table", "Print one row per run report (llmload run --json), e.g. one per API of the demo.")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errFlags, err)
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return usageErrorf("give one or more run reports")
	}
	return writeRunTable(os.Stdout, fs.Args())
}

// writeRunTable writes the table of tableCmd for the report files.
func writeRunTable(w io.Writer, files []string) error {
	t := &table{indent: "  ", tail: true}
	t.row("run", "api", "requests", "ok", "TTFT p50", "TTFT p99", "not ok")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		var rep RunReport
		if err := json.Unmarshal(b, &rep); err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		api := rep.Config.API
		if api == "" {
			api = APIChat
		}
		var bad []string
		for o, n := range rep.Summary.Outcomes {
			if o != OutcomeOK && n > 0 {
				bad = append(bad, fmt.Sprintf("%s %d", o, n))
			}
		}
		sort.Strings(bad)
		label := rep.Config.Label
		if label == "" {
			label = f
		}
		t.row(label, api, rep.Summary.Requests, rep.Summary.OK,
			fmt.Sprintf("%.0f ms", rep.Summary.TTFT.P50), fmt.Sprintf("%.0f ms", rep.Summary.TTFT.P99), strings.Join(bad, ", "))
	}
	var buf bytes.Buffer
	t.write(&buf)
	_, err := w.Write(buf.Bytes())
	return err
}
