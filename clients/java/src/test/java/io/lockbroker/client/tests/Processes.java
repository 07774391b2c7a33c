package io.lockbroker.client.tests;

import java.io.BufferedReader;
import java.io.File;
import java.io.IOException;
import java.io.InputStreamReader;
import java.net.ServerSocket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The real processes the tests run against: {@code redis-server} on a free loopback port, and
 * {@code lockbroker serve} on {@code 127.0.0.1:0}, whose port is read from its "serving" log
 * line. Both are started and stopped by the tests; every server binds 127.0.0.1.
 */
final class Processes {
    private Processes() {
    }

    /** A child process whose output is collected, and which completes {@code ready} on a line. */
    static class Child implements AutoCloseable {
        final Process process;
        final StringBuffer output = new StringBuffer();
        final CompletableFuture<Matcher> ready = new CompletableFuture<>();

        Child(List<String> command, Pattern readyLine) throws IOException {
            ProcessBuilder pb = new ProcessBuilder(command).redirectErrorStream(true);
            pb.environment().keySet().removeIf(name -> name.startsWith("LOCKBROKER_"));
            pb.redirectInput(ProcessBuilder.Redirect.from(new File("/dev/null")));
            process = pb.start();
            Thread reader = new Thread(() -> {
                try (BufferedReader in = new BufferedReader(
                        new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8))) {
                    String line;
                    while ((line = in.readLine()) != null) {
                        output.append(line).append('\n');
                        Matcher m = readyLine.matcher(line.replaceAll("\u001B\\[[0-9;]*m", ""));
                        if (m.find()) {
                            ready.complete(m);
                        }
                    }
                } catch (IOException e) {
                    // the process ended
                }
                ready.completeExceptionally(new IllegalStateException(
                        "exited before it was ready:\n" + output));
            }, "child-output");
            reader.setDaemon(true);
            reader.start();
        }

        Matcher awaitReady() throws Exception {
            try {
                return ready.get(15, TimeUnit.SECONDS);
            } catch (Exception e) {
                close();
                throw new IllegalStateException(String.join(" ", "did not start:", output.toString()), e);
            }
        }

        /** SIGTERM, then SIGKILL if it has not exited within 10 s. */
        void stop() throws InterruptedException {
            process.destroy();
            if (!process.waitFor(10, TimeUnit.SECONDS)) {
                process.destroyForcibly().waitFor();
            }
        }

        /** SIGKILL. */
        void kill() throws InterruptedException {
            process.destroyForcibly().waitFor();
        }

        @Override
        public void close() {
            process.destroyForcibly();
            try {
                process.waitFor(10, TimeUnit.SECONDS);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
    }

    static int freePort() throws IOException {
        try (ServerSocket s = new ServerSocket(0, 1, java.net.InetAddress.getLoopbackAddress())) {
            return s.getLocalPort();
        }
    }

    /** A {@code redis-server} with no persistence, on a free loopback port. */
    static final class Redis implements AutoCloseable {
        final int port;
        private final Path dir;
        private Child child;

        private Redis(int port, Path dir) {
            this.port = port;
            this.dir = dir;
        }

        static Redis start() throws Exception {
            Path dir = Files.createTempDirectory("lockbroker-java-redis");
            for (int attempt = 0; attempt < 5; attempt++) {
                Redis redis = new Redis(freePort(), dir);
                if (redis.launch()) {
                    return redis;
                }
            }
            throw new IllegalStateException("redis-server did not start on any free port");
        }

        String url() {
            return "redis://127.0.0.1:" + port;
        }

        private boolean launch() throws Exception {
            child = new Child(Arrays.asList("redis-server", "--port", String.valueOf(port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", dir.toString()),
                    Pattern.compile("Ready to accept connections"));
            try {
                child.ready.get(15, TimeUnit.SECONDS);
                return true;
            } catch (Exception e) {
                child.close();
                if (child.output.toString().contains("Address already in use")) {
                    return false;
                }
                throw new IllegalStateException("redis-server did not start:\n" + child.output, e);
            }
        }

        /** SIGKILL: the store is gone, with its data. */
        void kill() throws InterruptedException {
            child.kill();
        }

        /** A fresh, empty server on the same port (retried while the port is still busy). */
        void restart() throws Exception {
            child.close();
            for (int attempt = 0; attempt < 50; attempt++) {
                if (launch()) {
                    return;
                }
                Thread.sleep(100);
            }
            throw new IllegalStateException("port " + port + " stayed busy");
        }

        @Override
        public void close() {
            if (child != null) {
                child.close();
            }
        }
    }

    /** A {@code lockbroker serve} process. */
    static final class Broker implements AutoCloseable {
        private static final Pattern SERVING = Pattern.compile("lockbroker is serving addr=127\\.0\\.0\\.1:(\\d+)");
        final Child child;
        final int port;
        /** The auth file of a broker started by {@link #withAuth(String)}; null otherwise. */
        private Path authFile;

        private Broker(Child child, int port) {
            this.child = child;
            this.port = port;
        }

        /** A broker on the embedded store with auth on: {@code tokens} is the auth file's TOML. */
        static Broker withAuth(String tokens) throws Exception {
            Path file = Files.createTempDirectory("lockbroker-java-auth").resolve("auth.toml");
            Files.writeString(file, tokens);
            Broker broker = start(null, "--auth-file", file.toString());
            broker.authFile = file;
            return broker;
        }

        /** One {@code [[tokens]]} entry of an auth file. */
        static String token(String name, String secret, String prefix, String permission) {
            return "[[tokens]]\nname = \"" + name + "\"\ntoken = \"" + secret + "\"\nprefixes = [\"" + prefix
                    + "\"]\npermissions = [\"" + permission + "\"]\n\n";
        }

        /** Rewrites the auth file and has the broker read it again now (SIGHUP). */
        void reloadAuth(String tokens) throws Exception {
            Files.writeString(authFile, tokens);
            Process kill = new ProcessBuilder("kill", "-HUP", String.valueOf(child.process.pid()))
                    .redirectErrorStream(true).start();
            if (kill.waitFor() != 0) {
                throw new IllegalStateException("kill -HUP failed: " + new String(kill.getInputStream().readAllBytes(),
                        StandardCharsets.UTF_8));
            }
        }

        /** The binary: {@code $LOCKBROKER_BIN}, or the repository's debug build. */
        static String binary() {
            String bin = System.getenv("LOCKBROKER_BIN");
            if (bin != null && !bin.isEmpty()) {
                return bin;
            }
            return Path.of("..", "..", "target", "debug", "lockbroker").toAbsolutePath().normalize().toString();
        }

        /** A broker on {@code redisUrl} (null: the embedded store), with force release allowed. */
        static Broker start(String redisUrl, String... extra) throws Exception {
            List<String> command = new ArrayList<>(Arrays.asList(binary(), "serve", "--listen", "127.0.0.1:0",
                    "--allow-force-release", "--log-level", "info"));
            if (redisUrl != null) {
                command.addAll(Arrays.asList("--redis-url", redisUrl, "--store-timeout-ms", "300",
                        "--store-settle-ms", "1000"));
            }
            command.addAll(Arrays.asList(extra));
            if (!new File(command.get(0)).canExecute()) {
                throw new IllegalStateException("no lockbroker binary at " + command.get(0)
                        + " (build it with `cargo build --bin lockbroker`, or set LOCKBROKER_BIN)");
            }
            Child child = new Child(command, SERVING);
            Matcher m = child.awaitReady();
            return new Broker(child, Integer.parseInt(m.group(1)));
        }

        String url() {
            return "http://127.0.0.1:" + port;
        }

        void stop() throws InterruptedException {
            child.stop();
        }

        @Override
        public void close() {
            child.close();
        }
    }
}
