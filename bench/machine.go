package main

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// machineBusy returns the CPU time every process on the machine has spent
// since boot, in user and system mode (/proc/stat; Linux only). Interrupt
// time is left out: the kernel counts it apart from the processes it
// serves, this one's loopback traffic included.
func machineBusy() (time.Duration, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	// cpu  user nice system idle iowait irq softirq steal ...
	f := strings.Fields(line)
	if len(f) < 4 || f[0] != "cpu" {
		return 0, false
	}
	var ticks int64
	for _, v := range f[1:4] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, false
		}
		ticks += n
	}
	// /proc/stat counts in USER_HZ, 100 per second on every Linux
	// architecture Go runs on.
	return time.Duration(ticks) * (time.Second / 100), true
}
