package proxy

// errorBody is OpenAI's error envelope {"error":{"message","type","code"}},
// as tests decode the gateway's error bodies.
type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    string `json:"code"`
}
