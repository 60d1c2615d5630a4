// os/exec, signals and goroutines from a static Go program: runs
// /bin/echo through os/exec (clone with CLONE_VM|CLONE_VFORK) while
// goroutines compute (Go's SIGURG preemption interrupts them), and gets a
// signal of its own (SIGUSR1) through os/signal.
package main

import (
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
)

func spin(n int) uint64 {
	var h uint64 = 1
	for i := 0; i < n; i++ {
		h = h*6364136223846793005 + uint64(i)
	}
	return h
}

func main() {
	usr := make(chan os.Signal, 1)
	signal.Notify(usr, syscall.SIGUSR1)
	done := make(chan uint64, 4)
	for g := 0; g < 4; g++ {
		go func() { done <- spin(50_000_000) }()
	}
	for i := 0; i < 5; i++ {
		out, err := exec.Command("/bin/echo", "child", fmt.Sprint(i)).Output()
		if err != nil {
			fmt.Println("exec failed:", err)
			os.Exit(1)
		}
		fmt.Print(string(out))
	}
	var h uint64
	for g := 0; g < 4; g++ {
		h += <-done
	}
	syscall.Kill(os.Getpid(), syscall.SIGUSR1)
	<-usr
	fmt.Printf("signal ok %x\n", h)
}
