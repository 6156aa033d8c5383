package fleet

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Instance is a gateway of the fleet seen recently.
type Instance struct {
	// ID is its Config.InstanceID.
	ID string `json:"instance_id"`
	// LastSeen is its latest heartbeat, by Redis's clock (millisecond
	// precision), so instances' clocks need not agree.
	LastSeen time.Time `json:"last_seen"`
}

// The heartbeat, every Refresh while healthy: the instance's own key with
// a time-to-live of 3 × Refresh, and its entry in the index (a sorted set
// by last heartbeat, pruned of entries older than that, expiring with the
// fleet). Times are Redis's (TIME), so a skewed clock cannot hide an
// instance (replicate_commands lets Redis before 5 take TIME before a
// write; it does nothing on later ones). Both keys share the {instances}
// hash tag.
var heartbeatScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], now, 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return now
`)

// instancesScript returns the index's entries newer than ARGV[1]
// milliseconds by Redis's clock, with their scores.
var instancesScript = redis.NewScript(`
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf', 'WITHSCORES')
`)

// ttl is how long a heartbeat counts: 3 × Refresh.
func (c *Client) ttl() time.Duration { return 3 * c.cfg.Refresh }

func (c *Client) heartbeat(ctx context.Context) error {
	keys := []string{c.Key("instances", c.cfg.InstanceID), c.Key("instances")}
	return c.run(ctx, "heartbeat", func(ctx context.Context, r redis.Cmdable) error {
		return heartbeatScript.Run(ctx, r, keys, c.cfg.InstanceID, c.ttl().Milliseconds()).Err()
	})
}

// leave removes this instance's heartbeat, on Close.
func (c *Client) leave(ctx context.Context) error {
	return c.run(ctx, "leave", func(ctx context.Context, r redis.Cmdable) error {
		_, err := r.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Del(ctx, c.Key("instances", c.cfg.InstanceID))
			p.ZRem(ctx, c.Key("instances"), c.cfg.InstanceID)
			return nil
		})
		return err
	})
}

// Instances lists the instances whose heartbeat is at most 3 × Refresh
// old, this one included while healthy, newest first (then by id). In
// local mode it returns ErrDegraded.
func (c *Client) Instances(ctx context.Context) ([]Instance, error) {
	var res any
	err := c.Do(ctx, "instances", func(ctx context.Context, r redis.Cmdable) error {
		var err error
		res, err = instancesScript.Run(ctx, r, []string{c.Key("instances")}, c.ttl().Milliseconds()).Result()
		return err
	})
	if err != nil {
		return nil, err
	}
	flat, ok := res.([]any)
	if !ok {
		return nil, fmt.Errorf("fleet instances: unexpected reply %v", res)
	}
	out := make([]Instance, 0, len(flat)/2)
	for i := 0; i+1 < len(flat); i += 2 {
		id, _ := flat[i].(string)
		score, _ := flat[i+1].(string)
		ms, err := strconv.ParseFloat(score, 64)
		if id == "" || err != nil {
			return nil, fmt.Errorf("fleet instances: unexpected entry %v %v", flat[i], flat[i+1])
		}
		out = append(out, Instance{ID: id, LastSeen: time.UnixMilli(int64(ms)).UTC()})
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].LastSeen.Equal(out[j].LastSeen) {
			return out[i].LastSeen.After(out[j].LastSeen)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}
