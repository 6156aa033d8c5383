package fleet

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Defaults of Config.
const (
	DefaultKeyPrefix = "llmproxy:"
	DefaultOpTimeout = 50 * time.Millisecond
	DefaultRefresh   = time.Second
)

// Config is the connection to Redis and this instance's place in the
// fleet. Defaults fills in what is unset; Open does so itself.
type Config struct {
	// URL says where Redis is and how to reach it:
	//   redis://[[user]:password@]host:port[/db]       plain TCP
	//   rediss://[[user]:password@]host:port[/db]      TLS (server name from host)
	//   redis+sentinel://[[user]:password@]host:port[,host:port...]/<master>[/db]
	//   redis+cluster://[[user]:password@]host:port[,host:port...]   Redis Cluster (db 0 only)
	// A Sentinel URL's user and password are the Sentinels' own (most run
	// without); Password is the master's. A Cluster URL's are the nodes'. Timeouts and retries in the URL's
	// query are ignored: OpTimeout bounds everything. Required.
	URL string

	// Password authenticates to Redis (the master under Sentinel, every
	// node of a Cluster). It may also be given in a redis:// or
	// redis+cluster:// URL, but not both differently.
	// Default: none, or the URL's.
	Password string

	// DB is the database number. It may also be the URL's path (/3), but
	// not both differently. Default: 0, or the URL's.
	DB int

	// KeyPrefix starts every key this instance reads or writes, so that
	// fleets (or other applications) can share one Redis. A hash tag in
	// it ({…}) would put every key in one Cluster slot. Default "llmproxy:".
	KeyPrefix string

	// OpTimeout bounds every operation, connection setup included: the
	// most any request ever waits on Redis. At most Refresh / 2.
	// Default 50ms.
	OpTimeout time.Duration

	// Refresh is the interval of the background work: the heartbeat, which
	// also ends local mode once Redis takes it again (and, later, the bulk
	// refresh of shared state). Default 1s.
	Refresh time.Duration

	// InstanceID names this gateway in the fleet: its heartbeat key, and
	// the owner of what it writes (probe leases). Printable, without
	// spaces, at most 128 bytes. Default: the hostname, a dash and 6
	// random hex digits, new for each Open.
	InstanceID string

	// ExpectedInstances is how many gateways the fleet normally runs: in
	// local mode each enforces a fleet-wide limit ÷ this. Default 1.
	ExpectedInstances int

	// MinReporters is how many distinct instances must report failures of
	// an upstream before it opens fleet-wide (one instance alone with a
	// broken network path opens only its own breaker). Default 1.
	MinReporters int
}

// Defaults returns c with every unset field at its default, InstanceID
// generated when empty.
func (c Config) Defaults() Config {
	if c.KeyPrefix == "" {
		c.KeyPrefix = DefaultKeyPrefix
	}
	if c.OpTimeout == 0 {
		c.OpTimeout = DefaultOpTimeout
	}
	if c.Refresh == 0 {
		c.Refresh = DefaultRefresh
	}
	if c.InstanceID == "" {
		c.InstanceID = newInstanceID()
	}
	if c.ExpectedInstances == 0 {
		c.ExpectedInstances = 1
	}
	if c.MinReporters == 0 {
		c.MinReporters = 1
	}
	return c
}

// Validate reports the first setting that is out of range, or a URL that
// does not parse. It expects Defaults to have been applied.
func (c Config) Validate() error {
	if _, err := c.redisOptions(); err != nil {
		return err
	}
	switch {
	case c.OpTimeout <= 0:
		return fmt.Errorf("fleet: op_timeout %v: want a positive duration", c.OpTimeout)
	case c.Refresh <= 0:
		return fmt.Errorf("fleet: refresh %v: want a positive duration", c.Refresh)
	case c.OpTimeout > c.Refresh/2:
		return fmt.Errorf("fleet: op_timeout %v is more than half of refresh %v", c.OpTimeout, c.Refresh)
	case c.ExpectedInstances < 1:
		return fmt.Errorf("fleet: expected_instances %d: want at least 1", c.ExpectedInstances)
	case c.MinReporters < 1:
		return fmt.Errorf("fleet: min_reporters %d: want at least 1", c.MinReporters)
	case c.DB < 0:
		return fmt.Errorf("fleet: db %d: want 0 or more", c.DB)
	}
	if c.KeyPrefix == "" || strings.IndexFunc(c.KeyPrefix, unicode.IsSpace) >= 0 {
		return fmt.Errorf("fleet: key_prefix %q: want a non-empty prefix without spaces", c.KeyPrefix)
	}
	if c.InstanceID == "" || len(c.InstanceID) > 128 || strings.IndexFunc(c.InstanceID, func(r rune) bool { return !unicode.IsPrint(r) || unicode.IsSpace(r) }) >= 0 {
		return fmt.Errorf("fleet: instance_id %q: want 1 to 128 printable characters without spaces", c.InstanceID)
	}
	return nil
}

// newInstanceID is the hostname, a dash and 6 random hex digits.
func newInstanceID() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "gateway"
	}
	host = strings.Map(func(r rune) rune {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return '_'
		}
		return r
	}, host)
	if len(host) > 120 {
		host = host[:120]
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

// redisOptions turns the URL and settings into go-redis options: a plain
// or TLS client, a Sentinel failover client (MasterName set), or a Cluster
// client (IsClusterMode set).
func (c Config) redisOptions() (*redis.UniversalOptions, error) {
	if c.URL == "" {
		return nil, errors.New("fleet: no redis URL")
	}
	u, err := url.Parse(c.URL)
	if err != nil {
		return nil, fmt.Errorf("fleet: redis URL: %w", redactErr(err, c.URL))
	}
	var o redis.UniversalOptions
	var urlPassword string
	var urlDB int
	switch u.Scheme {
	case "redis", "rediss":
		po, err := redis.ParseURL(c.URL)
		if err != nil {
			return nil, fmt.Errorf("fleet: redis URL %s: %w", redact(c.URL), redactErr(err, c.URL))
		}
		o.Addrs = []string{po.Addr}
		o.Username, urlPassword, urlDB = po.Username, po.Password, po.DB
		o.TLSConfig = po.TLSConfig
	case "redis+sentinel":
		hosts, rest, _ := strings.Cut(strings.TrimPrefix(u.Host+u.Path, "/"), "/")
		for _, h := range strings.Split(hosts, ",") {
			if _, _, err := net.SplitHostPort(h); err != nil {
				return nil, fmt.Errorf("fleet: redis URL %s: sentinel %q: want host:port", redact(c.URL), h)
			}
			o.Addrs = append(o.Addrs, h)
		}
		master, db, hasDB := strings.Cut(rest, "/")
		if master == "" {
			return nil, fmt.Errorf("fleet: redis URL %s: no master name: want redis+sentinel://host:port[,host:port]/<master>[/db]", redact(c.URL))
		}
		o.MasterName = master
		if hasDB {
			if urlDB, err = strconv.Atoi(db); err != nil || urlDB < 0 {
				return nil, fmt.Errorf("fleet: redis URL %s: bad db %q", redact(c.URL), db)
			}
		}
		if u.User != nil {
			o.SentinelUsername = u.User.Username()
			o.SentinelPassword, _ = u.User.Password()
		}
	case "redis+cluster":
		if p := strings.Trim(u.Path, "/"); p != "" {
			return nil, fmt.Errorf("fleet: redis URL %s: path %q: a Cluster has only db 0: want redis+cluster://host:port[,host:port]", redact(c.URL), p)
		}
		for _, h := range strings.Split(u.Host, ",") {
			if _, _, err := net.SplitHostPort(h); err != nil {
				return nil, fmt.Errorf("fleet: redis URL %s: node %q: want host:port", redact(c.URL), h)
			}
			o.Addrs = append(o.Addrs, h)
		}
		if c.DB != 0 {
			return nil, fmt.Errorf("fleet: db %d: a Redis Cluster has only db 0", c.DB)
		}
		if u.User != nil {
			o.Username = u.User.Username()
			urlPassword, _ = u.User.Password()
		}
		o.IsClusterMode = true
	default:
		return nil, fmt.Errorf("fleet: redis URL %s: scheme %q: want redis, rediss, redis+sentinel or redis+cluster", redact(c.URL), u.Scheme)
	}
	switch {
	case c.Password != "" && urlPassword != "" && c.Password != urlPassword:
		return nil, errors.New("fleet: two different passwords, in the URL and in password: give one")
	case c.DB != 0 && urlDB != 0 && c.DB != urlDB:
		return nil, fmt.Errorf("fleet: db %d and the URL's db %d differ: give one", c.DB, urlDB)
	}
	o.Password = c.Password
	if o.Password == "" {
		o.Password = urlPassword
	}
	o.DB = c.DB
	if o.DB == 0 {
		o.DB = urlDB
	}

	// Every operation is bounded by its context (OpTimeout). No retries:
	// a command that timed out may have been applied, and replaying it
	// could charge twice; the caller decides. Dials go on in the
	// background for up to dialTimeout so that the next operation finds a
	// connection, but no operation waits for them past its context.
	o.ContextTimeoutEnabled = true
	o.MaxRetries = -1
	o.DialTimeout = max(time.Second, c.OpTimeout)
	o.DialerRetries = 1
	o.ReadTimeout = c.OpTimeout
	o.WriteTimeout = c.OpTimeout
	o.PoolTimeout = c.OpTimeout
	// RESP2 and no CLIENT SETINFO: the fewest round trips per new
	// connection, and any Redis-compatible server.
	o.Protocol = 2
	o.DisableIdentity = true
	// A Cluster follows MOVED and ASK redirects (up to 3, within the
	// operation's context); a lost connection after sending is not
	// replayed there either (see noReplay).
	o.MaxRedirects = 3
	o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return &o, nil
}

// redact hides the password of a URL for logs and errors.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

// redactErr replaces the URL in a parse error, which may hold a password.
func redactErr(err error, raw string) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	if strings.Contains(err.Error(), raw) {
		return errors.New(strings.ReplaceAll(err.Error(), raw, redact(raw)))
	}
	return err
}
