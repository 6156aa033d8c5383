package fleet

import "strings"

// Key returns the key of one field of a logical object (a breaker, a
// tenant, the instance list):
//
//	<prefix>{<object>}:<field>[:<field>...]      Key("breaker:10.0.0.2:8000", "open")
//	<prefix>{<object>}                           Key("instances")
//
// Every key of one object carries the same hash tag, {<object>}, so they
// sit in one Redis Cluster slot and a script or transaction may touch them
// together; different objects spread over the slots. Braces in object are
// escaped (%7B, %7D) so the tag is always the whole object, and an empty
// object is "_" (an empty tag would hash the whole key).
func (c *Client) Key(object string, fields ...string) string {
	return buildKey(c.cfg.KeyPrefix, object, fields...)
}

func buildKey(prefix, object string, fields ...string) string {
	if object == "" {
		object = "_"
	}
	if strings.ContainsAny(object, "{}") {
		object = strings.NewReplacer("{", "%7B", "}", "%7D").Replace(object)
	}
	n := len(prefix) + len(object) + 2
	for _, f := range fields {
		n += len(f) + 1
	}
	var b strings.Builder
	b.Grow(n)
	b.WriteString(prefix)
	b.WriteByte('{')
	b.WriteString(object)
	b.WriteByte('}')
	for _, f := range fields {
		b.WriteByte(':')
		b.WriteString(f)
	}
	return b.String()
}
