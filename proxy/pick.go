package proxy

// pick is step 4: the Balancer chooses the upstream for the next attempt.
// Candidate filtering (breakers, saturation, already tried) and the permit
// are the Balancer's; the proxy tells it what was tried and whether this is
// a backup, which only an upstream with a closed breaker may take.
func (rc *race) pick(hedge bool) (Upstream, error) {
	x := rc.x
	return rc.pool.Balancer.Pick(x.w, x.r, PickRequest{Info: x.result.Info, Tried: rc.tried, Hedge: hedge, Prompt: x.prompt})
}

// prompt yields the prompt text of the body the attempt sends, as its API
// reads it, where the request's parse found it.
func (x *exchange) prompt(yield func(string) bool) { x.result.Info.PromptText(x.body, yield) }

// release gives back an upstream that was picked but not used (a retry
// that backs off first): its permit and in-flight count are not held
// through the wait.
func release(up Upstream) {
	if up.Done != nil {
		up.Done(nil)
	}
}
