package fleet

import (
	"strings"
	"testing"
	"time"
)

func TestURLFormsBecomeGoRedisOptions(t *testing.T) {
	for _, tc := range []struct {
		name, url, password string
		db                  int
		addrs               []string
		master, wantPass    string
		wantDB              int
		tls                 bool
		sentinelPass        string
	}{
		{name: "plain", url: "redis://10.0.0.5:6379", addrs: []string{"10.0.0.5:6379"}},
		{name: "default port", url: "redis://redis.internal", addrs: []string{"redis.internal:6379"}},
		{name: "db and password in the URL", url: "redis://:pw@10.0.0.5:6380/3", addrs: []string{"10.0.0.5:6380"}, wantPass: "pw", wantDB: 3},
		{name: "db and password as settings", url: "redis://10.0.0.5:6380", password: "pw", db: 4, addrs: []string{"10.0.0.5:6380"}, wantPass: "pw", wantDB: 4},
		{name: "the same db both ways", url: "redis://10.0.0.5/2", db: 2, addrs: []string{"10.0.0.5:6379"}, wantDB: 2},
		{name: "tls", url: "rediss://redis.internal:6380", addrs: []string{"redis.internal:6380"}, tls: true},
		{name: "sentinel", url: "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster", password: "pw",
			addrs: []string{"10.0.0.1:26379", "10.0.0.2:26379"}, master: "mymaster", wantPass: "pw"},
		{name: "sentinel with db and its own password", url: "redis+sentinel://:spw@10.0.0.1:26379/mymaster/5",
			addrs: []string{"10.0.0.1:26379"}, master: "mymaster", wantDB: 5, sentinelPass: "spw"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := Config{URL: tc.url, Password: tc.password, DB: tc.db}.Defaults().redisOptions()
			if err != nil {
				t.Fatal(err)
			}
			if strings.Join(o.Addrs, ",") != strings.Join(tc.addrs, ",") || o.MasterName != tc.master ||
				o.Password != tc.wantPass || o.DB != tc.wantDB || (o.TLSConfig != nil) != tc.tls || o.SentinelPassword != tc.sentinelPass {
				t.Fatalf("options: addrs %v master %q password %q db %d tls %v sentinel password %q",
					o.Addrs, o.MasterName, o.Password, o.DB, o.TLSConfig != nil, o.SentinelPassword)
			}
			if tc.tls && o.TLSConfig.ServerName != "redis.internal" {
				t.Errorf("TLS server name %q", o.TLSConfig.ServerName)
			}
			if o.MaxRetries != -1 || !o.ContextTimeoutEnabled || o.ReadTimeout != DefaultOpTimeout || o.PoolTimeout != DefaultOpTimeout {
				t.Errorf("not bounded by op_timeout: retries %d, context timeouts %v, read %v, pool %v",
					o.MaxRetries, o.ContextTimeoutEnabled, o.ReadTimeout, o.PoolTimeout)
			}
		})
	}
}

func TestBadURLsAreRefusedWithoutTheirPassword(t *testing.T) {
	for _, tc := range []struct {
		name, url, password string
		db                  int
		want                string
	}{
		{name: "no URL", want: "no redis URL"},
		{name: "scheme", url: "http://:hunter2@10.0.0.5", want: `scheme "http": want redis, rediss, redis+sentinel or redis+cluster`},
		{name: "sentinel without master", url: "redis+sentinel://:hunter2@10.0.0.1:26379", want: "no master name"},
		{name: "sentinel without port", url: "redis+sentinel://10.0.0.1/m", want: `sentinel "10.0.0.1": want host:port`},
		{name: "sentinel bad db", url: "redis+sentinel://10.0.0.1:26379/m/x", want: `bad db "x"`},
		{name: "two passwords", url: "redis://:hunter2@10.0.0.5", password: "other", want: "two different passwords"},
		{name: "two dbs", url: "redis://:hunter2@10.0.0.5/3", db: 4, want: "db 4 and the URL's db 3 differ"},
		{name: "bad db path", url: "redis://:hunter2@10.0.0.5/x", want: "invalid database number"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Config{URL: tc.url, Password: tc.password, DB: tc.db}.Defaults().Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want an error containing %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("the error shows the password: %v", err)
			}
		})
	}
}

func TestDefaults(t *testing.T) {
	c := Config{URL: "redis://127.0.0.1:6379"}.Defaults()
	if c.KeyPrefix != "llmproxy:" || c.OpTimeout != 50*time.Millisecond || c.Refresh != time.Second ||
		c.ExpectedInstances != 1 || c.MinReporters != 1 {
		t.Fatalf("defaults: %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	other := Config{URL: "redis://127.0.0.1:6379"}.Defaults()
	if c.InstanceID == "" || c.InstanceID == other.InstanceID || !strings.Contains(c.InstanceID, "-") {
		t.Fatalf("generated instance ids %q and %q: want hostname-suffix, each new", c.InstanceID, other.InstanceID)
	}
	if kept := (Config{URL: "redis://h:1", InstanceID: "gw-1"}).Defaults(); kept.InstanceID != "gw-1" {
		t.Fatalf("InstanceID %q, want the configured one", kept.InstanceID)
	}
}

func TestValidateRanges(t *testing.T) {
	base := Config{URL: "redis://127.0.0.1:6379"}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"op_timeout over half of refresh", func(c *Config) { c.OpTimeout = 600 * time.Millisecond }, "more than half of refresh"},
		{"negative op_timeout", func(c *Config) { c.OpTimeout = -1 }, "op_timeout"},
		{"negative refresh", func(c *Config) { c.Refresh = -time.Second }, "refresh"},
		{"expected_instances", func(c *Config) { c.ExpectedInstances = -2 }, "expected_instances -2"},
		{"min_reporters", func(c *Config) { c.MinReporters = -1 }, "min_reporters -1"},
		{"db", func(c *Config) { c.DB = -1 }, "db -1"},
		{"key_prefix with a space", func(c *Config) { c.KeyPrefix = "llm proxy:" }, "key_prefix"},
		{"instance_id with a space", func(c *Config) { c.InstanceID = "gw 1" }, "instance_id"},
		{"instance_id too long", func(c *Config) { c.InstanceID = strings.Repeat("x", 129) }, "instance_id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.mod(&c)
			err := c.Defaults().Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// hashTag is the part of a key that Redis Cluster hashes: the text between
// the first "{" and the next "}" when that is not empty, else the key.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

func TestKeysOfOneObjectShareAHashTag(t *testing.T) {
	c := &Client{cfg: Config{KeyPrefix: "llmproxy:"}}
	for _, tc := range []struct {
		object string
		fields []string
		want   string
	}{
		{"instances", nil, "llmproxy:{instances}"},
		{"instances", []string{"gw-1"}, "llmproxy:{instances}:gw-1"},
		{"breaker:10.0.0.2:8000", []string{"open"}, "llmproxy:{breaker:10.0.0.2:8000}:open"},
		{"breaker:10.0.0.2:8000|m", []string{"window", "17"}, "llmproxy:{breaker:10.0.0.2:8000|m}:window:17"},
		{"odd{name}", []string{"x"}, "llmproxy:{odd%7Bname%7D}:x"},
		{"}start", []string{"x"}, "llmproxy:{%7Dstart}:x"},
		{"", []string{"x"}, "llmproxy:{_}:x"},
	} {
		got := c.Key(tc.object, tc.fields...)
		if got != tc.want {
			t.Errorf("Key(%q, %q) = %q, want %q", tc.object, tc.fields, got, tc.want)
		}
	}
	// Every field of an object hashes like the object; objects differ.
	a, b := c.Key("tenant:acme", "rpm"), c.Key("tenant:acme", "leases")
	if hashTag(a) != hashTag(b) || hashTag(a) != "tenant:acme" {
		t.Errorf("tags %q and %q", hashTag(a), hashTag(b))
	}
	if hashTag(c.Key("}x", "1")) != hashTag(c.Key("}x", "2")) || hashTag(c.Key("}x", "1")) == "" {
		t.Errorf("an object starting with } must still give one non-empty tag: %q", c.Key("}x", "1"))
	}
	if hashTag(c.Key("tenant:a")) == hashTag(c.Key("tenant:b")) {
		t.Error("two objects share a tag")
	}
}

func TestErrorReplyKinds(t *testing.T) {
	for msg, want := range map[string]ErrorKind{
		"READONLY You can't write against a read only replica.":             KindReadonly,
		"NOSCRIPT No matching script. Please use EVAL.":                     KindScript,
		"ERR user_script:1: Script attempted to access nonexistent global":  KindScript,
		"ERR Error running script (call to f_123): @user_script:1: boom":    KindScript,
		"LOADING Redis is loading the dataset in memory":                    KindConn,
		"NOAUTH Authentication required.":                                   KindConn,
		"WRONGPASS invalid username-password pair or user is disabled.":     KindConn,
		"ERR max number of clients reached":                                 KindConn,
		"WRONGTYPE Operation against a key holding the wrong kind of value": KindOther,
		"ERR wrong number of arguments for 'get' command":                   KindOther,
	} {
		if got := replyKind(msg); got != want {
			t.Errorf("replyKind(%q) = %q, want %q", msg, got, want)
		}
	}
}
