// Package redistest runs a real redis-server for tests, and a TCP fault
// proxy to put in front of it (pass, latency, blackhole, reset).
//
// A Server is a redis-server child process listening on a free loopback
// port, without persistence (--save "" --appendonly no), in a temporary
// directory, stopped when the test ends. It comes from Debian's package
// redis-server, which scripts/setup-test.sh installs (make test runs it
// first); when the binary is missing, Start tries to install it once with
// apt-get and skips the test, saying why, only if that fails too.
//
// It imports only the standard library.
package redistest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Options are a Server's settings. The zero value is a server without
// password.
type Options struct {
	// Password is given as --requirepass; every client must AUTH with it.
	// Default: none.
	Password string
	// Args are more redis-server arguments, such as "--maxmemory", "1mb".
	Args []string
}

// Server is a running redis-server. Its methods are safe for concurrent
// use; Restart and Stop fail the test on error.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	port int
	opts Options

	// sentinel, when set, makes this a Sentinel monitoring a master.
	sentinel *sentinelOf

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	runs int
}

// Start starts a redis-server on a free loopback port and stops it when
// the test ends. It skips the test when redis-server is absent and cannot
// be installed.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	bin := binary(t)
	s := &Server{t: t, bin: bin, dir: t.TempDir(), opts: opts}
	s.launch()
	return s
}

// launch starts s on a free port and stops it when the test ends.
func (s *Server) launch() {
	s.t.Helper()
	var err error
	for try := 0; try < 5; try++ { // a free port may be taken before redis binds it
		if s.port, err = freePort(); err != nil {
			continue
		}
		if err = s.start(); err == nil {
			break
		}
	}
	if err != nil {
		s.t.Fatalf("redistest: starting redis-server: %v", err)
	}
	s.t.Cleanup(s.Stop)
}

// sentinelOf is the master that a Sentinel monitors, and its name.
type sentinelOf struct {
	master *Server
	name   string
}

// StartSentinel starts a Sentinel (redis-server --sentinel, no password of
// its own) on a free loopback port that monitors master under name, with
// quorum 1 and the master's password, and stops it when the test ends. A
// client asks it for the master's address: redis+sentinel://<Addr>/<name>.
func StartSentinel(t testing.TB, master *Server, name string) *Server {
	t.Helper()
	s := &Server{t: t, bin: binary(t), dir: t.TempDir(), sentinel: &sentinelOf{master: master, name: name}}
	s.launch()
	return s
}

// Addr is the server's host:port on 127.0.0.1; it stays the same across
// Restart.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// URL is redis://[:password@]host:port for the server.
func (s *Server) URL() string {
	if s.opts.Password != "" {
		return "redis://:" + s.opts.Password + "@" + s.Addr()
	}
	return "redis://" + s.Addr()
}

// Password is the server's requirepass, empty for none.
func (s *Server) Password() string { return s.opts.Password }

// Restart replaces the process with a fresh one on the same port: no data,
// an empty script cache, every client connection gone. It waits until the
// new one answers PING.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	var err error
	for try := 0; try < 20; try++ { // the port can take a moment to be free again
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.t.Fatalf("redistest: restarting redis-server on %s: %v", s.Addr(), err)
}

// Stop kills the process (SIGKILL: a crash, nothing flushed) and waits for
// it to exit. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}

// Do sends one command on a new connection (after AUTH when the server has
// a password) and returns the reply as text: a simple or bulk string, an
// integer, or the elements of an array joined by newlines. A Redis error
// reply is returned as an error. For a test's own checks and setup, such
// as Do("REPLICAOF", "127.0.0.1", "1").
func (s *Server) Do(args ...string) (string, error) {
	return command(s.Addr(), s.opts.Password, 2*time.Second, args...)
}

// start runs redis-server and waits until it answers.
func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runs++
	logFile := filepath.Join(s.dir, fmt.Sprintf("redis-%d.log", s.runs))
	args, err := s.args(logFile)
	if err != nil {
		return err
	}
	cmd := exec.Command(s.bin, args...)
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	if err := waitReady(s.Addr(), s.opts.Password, done); err != nil {
		_ = cmd.Process.Kill()
		<-done
		b, _ := os.ReadFile(logFile)
		return fmt.Errorf("%w; log:\n%s", err, lastLines(string(b), 10))
	}
	s.cmd, s.done = cmd, done
	return nil
}

// args are the command line of the next run.
func (s *Server) args(logFile string) ([]string, error) {
	if m := s.sentinel; m != nil {
		// Sentinel takes its settings from a file that it rewrites.
		conf := fmt.Sprintf("port %d\nbind 127.0.0.1\ndaemonize no\nprotected-mode no\ndir %s\nlogfile %s\n"+
			"sentinel monitor %s 127.0.0.1 %d 1\n", s.port, s.dir, logFile, m.name, m.master.port)
		if m.master.opts.Password != "" {
			conf += fmt.Sprintf("sentinel auth-pass %s %s\n", m.name, m.master.opts.Password)
		}
		path := filepath.Join(s.dir, fmt.Sprintf("sentinel-%d.conf", s.runs))
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			return nil, err
		}
		return []string{path, "--sentinel"}, nil
	}
	args := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--dir", s.dir,
		"--dbfilename", "dump.rdb",
		"--daemonize", "no",
		"--protected-mode", "no",
		"--logfile", logFile,
	}
	if s.opts.Password != "" {
		args = append(args, "--requirepass", s.opts.Password)
	}
	return append(args, s.opts.Args...), nil
}

// waitReady polls PING for up to 5s, failing early if the process exits.
func waitReady(addr, password string, exited <-chan struct{}) error {
	deadline := time.Now().Add(5 * time.Second)
	var err error
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			return fmt.Errorf("redis-server on %s exited at start", addr)
		default:
		}
		var reply string
		if reply, err = command(addr, password, 500*time.Millisecond, "PING"); err == nil && reply == "PONG" {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("redis-server on %s not ready after 5s: %v", addr, err)
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// command sends one RESP command and reads one reply, all within timeout.
func command(addr, password string, timeout time.Duration, args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	r := bufio.NewReader(c)
	if password != "" {
		if _, err := roundTrip(c, r, "AUTH", password); err != nil {
			return "", err
		}
	}
	return roundTrip(c, r, args...)
}

func roundTrip(c net.Conn, r *bufio.Reader, args ...string) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(b.String())); err != nil {
		return "", err
	}
	return readReply(r)
}

// readReply reads one RESP2 reply; an array's elements are joined by "\n".
func readReply(r *bufio.Reader) (string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return "", errors.New("redistest: empty reply line")
	}
	switch body := line[1:]; line[0] {
	case '+', ':':
		return body, nil
	case '-':
		return "", errors.New(body)
	case '$':
		n, err := strconv.Atoi(body)
		if err != nil || n < 0 {
			return "", err // nil bulk string: "", nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	case '*':
		n, err := strconv.Atoi(body)
		if err != nil || n < 0 {
			return "", err
		}
		parts := make([]string, n)
		for i := range parts {
			if parts[i], err = readReply(r); err != nil {
				return "", err
			}
		}
		return strings.Join(parts, "\n"), nil
	}
	return "", fmt.Errorf("redistest: unexpected reply %q", line)
}

// binary finds redis-server, installing Debian's package once per process
// when it is missing; it skips the test when that is impossible.
func binary(t testing.TB) string {
	t.Helper()
	install.Do(func() {
		if p, err := exec.LookPath("redis-server"); err == nil {
			install.path = p
			return
		}
		install.err = aptInstall()
		if p, err := exec.LookPath("redis-server"); err == nil {
			install.path, install.err = p, nil
		} else if install.err == nil {
			install.err = err
		}
	})
	if install.path == "" {
		t.Skipf("redistest: redis-server is not installed and could not be installed (%v); run scripts/setup-test.sh (apt-get install redis-server)", install.err)
	}
	return install.path
}

var install struct {
	sync.Once
	path string
	err  error
}

// aptInstall runs apt-get install redis-server (after apt-get update when
// the first try fails), as root or through sudo.
func aptInstall() error {
	if _, err := exec.LookPath("apt-get"); err != nil {
		return errors.New("no apt-get")
	}
	var prefix []string
	if os.Geteuid() != 0 {
		if _, err := exec.LookPath("sudo"); err != nil {
			return errors.New("not root and no sudo")
		}
		prefix = []string{"sudo", "-n"}
	}
	run := func(args ...string) error {
		full := append(append([]string{}, prefix...), args...)
		cmd := exec.Command(full[0], full[1:]...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, lastLines(string(out), 3))
		}
		return nil
	}
	install := []string{"apt-get", "install", "-y", "-qq", "redis-server"}
	if err := run(install...); err == nil {
		return nil
	}
	if err := run("apt-get", "update", "-qq"); err != nil {
		return err
	}
	return run(install...)
}
