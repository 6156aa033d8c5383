package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat:
// 100 on every Linux architecture Go supports (the kernel's ABI constant,
// what `getconf CLK_TCK` prints), so CPU time is read in 10 ms steps.
const clockTicks = 100

// procStat is what S4/S4b read of one process from /proc/<pid>/stat.
type procStat struct {
	PPID int
	// CPUTicks is utime + stime: CPU time in user and kernel mode, in
	// clock ticks (1/clockTicks s), of every thread of the process.
	CPUTicks int64
}

// parseProcStat parses the contents of /proc/<pid>/stat. The command name
// (field 2) may hold spaces and parentheses, so fields are counted from
// the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("stat %q: no ')'", truncate(string(b), 60))
	}
	// After ')': field 3 (state) is f[0], so field n is f[n-3].
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return procStat{}, fmt.Errorf("stat: %d fields after the name, want at least 13", len(f))
	}
	ppid, err1 := strconv.Atoi(f[4-3])
	ut, err2 := strconv.ParseInt(f[14-3], 10, 64)
	st, err3 := strconv.ParseInt(f[15-3], 10, 64)
	if err1 != nil || err2 != nil || err3 != nil {
		return procStat{}, fmt.Errorf("stat: ppid %q utime %q stime %q", f[1], f[11], f[12])
	}
	return procStat{PPID: ppid, CPUTicks: ut + st}, nil
}

// readProcStat reads /proc/<pid>/stat.
func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(b)
}

// parseStatusKB returns the value in kB of a "Key:   123 kB" line of
// /proc/<pid>/status (VmRSS, VmHWM), or an error when the key is missing.
func parseStatusKB(b []byte, key string) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || k != key {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			break
		}
		return strconv.ParseInt(f[0], 10, 64)
	}
	return 0, fmt.Errorf("status: no %s", key)
}

// readRSSKB reads VmRSS of a process, in kB.
func readRSSKB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	return parseStatusKB(b, "VmRSS")
}

// parseMaxOpenFiles returns the soft "Max open files" of /proc/<pid>/limits
// (-1 for unlimited).
func parseMaxOpenFiles(b []byte) (int64, error) {
	for line := range strings.SplitSeq(string(b), "\n") {
		if !strings.HasPrefix(line, "Max open files") {
			continue
		}
		f := strings.Fields(strings.TrimPrefix(line, "Max open files"))
		if len(f) == 0 {
			break
		}
		if f[0] == "unlimited" {
			return -1, nil
		}
		return strconv.ParseInt(f[0], 10, 64)
	}
	return 0, fmt.Errorf("limits: no Max open files line")
}

// processTree returns pid and its descendants (nginx's workers are children
// of its master), pid first.
func processTree(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := readProcStat(p)
		if err != nil {
			continue
		}
		children[st.PPID] = append(children[st.PPID], p)
	}
	out := []int{pid}
	for i := 0; i < len(out); i++ {
		out = append(out, children[out[i]]...)
	}
	return out
}

// procSample is the summed CPU time and RSS of a process tree at one moment.
type procSample struct {
	CPUTicks int64
	RSSKB    int64
}

// sampleProcs sums utime+stime and VmRSS over pids. A process that is gone
// is an error: its CPU time would silently drop out of the sum.
func sampleProcs(pids []int) (procSample, error) {
	var s procSample
	for _, pid := range pids {
		st, err := readProcStat(pid)
		if err != nil {
			return s, fmt.Errorf("process %d: %w", pid, err)
		}
		rss, err := readRSSKB(pid)
		if err != nil {
			return s, fmt.Errorf("process %d: %w", pid, err)
		}
		s.CPUTicks += st.CPUTicks
		s.RSSKB += rss
	}
	return s, nil
}

// fdLimit is the smallest soft open-files limit among pids (-1 when every
// one is unlimited), or an error when /proc cannot tell.
func fdLimit(pids []int) (int64, error) {
	lim := int64(-1)
	for _, pid := range pids {
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "limits"))
		if err != nil {
			return 0, err
		}
		n, err := parseMaxOpenFiles(b)
		if err != nil {
			return 0, err
		}
		if n >= 0 && (lim < 0 || n < lim) {
			lim = n
		}
	}
	return lim, nil
}

// ownFDLimit is this process's soft open-files limit (Go raises it to the
// hard limit at start).
func ownFDLimit() int64 {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil {
		return -1
	}
	return int64(r.Cur)
}

// memAvailableKB is MemAvailable of /proc/meminfo, -1 when unknown.
func memAvailableKB() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return -1
	}
	n, err := parseStatusKB(b, "MemAvailable")
	if err != nil {
		return -1
	}
	return n
}

// parseSchedstat returns the first field of /proc/<pid>/task/<tid>/schedstat:
// the time the thread has spent on a CPU, in ns (exact, unlike stat's
// 10 ms ticks).
func parseSchedstat(b []byte) (int64, error) {
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, fmt.Errorf("schedstat: empty")
	}
	return strconv.ParseInt(f[0], 10, 64)
}

// treeCPUNanos sums the CPU time in ns of every thread of pid and its
// descendants. A thread that exited takes its time with it (Go and nginx
// keep theirs), so differences are taken over short windows only.
func treeCPUNanos(pid int) (int64, error) {
	var sum int64
	for _, p := range processTree(pid) {
		dir := filepath.Join("/proc", strconv.Itoa(p), "task")
		tasks, err := os.ReadDir(dir)
		if err != nil {
			return 0, err
		}
		for _, t := range tasks {
			b, err := os.ReadFile(filepath.Join(dir, t.Name(), "schedstat"))
			if err != nil {
				continue // the thread exited as we read
			}
			ns, err := parseSchedstat(b)
			if err != nil {
				return 0, err
			}
			sum += ns
		}
	}
	return sum, nil
}
