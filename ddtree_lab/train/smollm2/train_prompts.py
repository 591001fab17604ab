"""Training prompts for the SmolLM2 drafter, composed offline from templates x topics.

Written for this project; nothing is downloaded. `build(n, seed)` returns n distinct user messages
(deterministic for a seed) mixing instructions and chat, code tasks, short math word problems and
reasoning questions, the kinds of request the held-out sets in prompts/ ask. Any message that equals a
held-out prompt (after lower-casing and dropping punctuation) is skipped, so none is trained on.
The drafter learns the target's *responses*; the prompts only have to steer it over many styles.
"""
from __future__ import annotations

import json
import random
import re

# ---------------------------------------------------------------- chat and instructions
CHAT_TOPICS = [
    "learning a new language", "starting a vegetable garden", "running a first 5k race", "cooking rice",
    "saving for a holiday", "keeping houseplants alive", "studying for exams", "moving to a new city",
    "writing a cover letter", "training a puppy", "reducing stress at work", "planning a birthday party",
    "learning to play the guitar", "choosing a laptop", "making friends as an adult", "baking bread",
    "keeping a journal", "cycling to work", "organising a small kitchen", "camping in the rain",
    "drinking more water", "reading more books", "preparing for a job interview", "visiting a museum",
    "teaching a child to ride a bike", "cleaning a bathroom quickly", "hosting a board game night",
    "recycling electronics", "taking better photos with a phone", "meal prepping for the week",
    "watching birds", "learning to swim", "writing a speech for a friend's wedding", "composting",
    "travelling by train", "staying focused while studying", "decorating a small bedroom", "knitting",
    "saving energy at home", "buying a used car", "volunteering locally", "starting a book club",
    "caring for a goldfish", "painting with watercolours", "walking more every day", "making tea",
    "keeping a budget", "learning chess", "fixing a flat bicycle tyre", "planning a road trip",
]
CHAT_SUBJECTS = [
    "the moon", "volcanoes", "rainbows", "the human heart", "electricity", "earthquakes", "tides",
    "the Roman Empire", "the printing press", "glaciers", "coral reefs", "the internet", "magnets",
    "dinosaurs", "clouds", "the immune system", "deserts", "compound interest", "gravity", "wind turbines",
    "the Great Wall of China", "solar panels", "honeybees", "the Olympic Games", "ancient Egypt",
    "photosynthesis in algae", "thunderstorms", "the stock market", "rain forests", "the seasons",
    "migrating birds", "the periodic table", "sound waves", "lighthouses", "the Silk Road", "penguins",
    "submarines", "the Renaissance", "bridges", "octopuses", "the speed of light", "maps", "bicycles",
    "money", "democracy", "mushrooms", "tea", "coffee", "paper", "glass", "clocks", "the alphabet",
]
CHAT_TEMPLATES = [
    "Give me {k} tips for {topic}.", "What are the most common mistakes people make when {topic}?",
    "I'm new to {topic}. Where should I start?", "Write a short motivational message about {topic}.",
    "Make a simple checklist for {topic}.", "What are the pros and cons of {topic}?",
    "Write a friendly text message asking a friend to help me with {topic}.",
    "Explain {subject} to a child in a few sentences.", "Tell me three interesting facts about {subject}.",
    "Write a short poem about {subject}.", "Summarize what you know about {subject} in one paragraph.",
    "Why is {subject} important?", "Write a haiku about {subject}.", "Describe {subject} in {k} bullet points.",
    "Write a short story for children about {subject}.", "What questions could a student ask about {subject}?",
    "Explain how {subject} works, step by step.", "Write a limerick about {subject}.",
    "Give me a fun quiz with {k} questions about {subject}.", "Write a tweet about {subject}.",
    "Compare {subject} and {subject2} in a short paragraph.", "What do {subject} and {subject2} have in common?",
    "Write a short dialogue between two friends about {topic}.", "Plan a {k}-day schedule for {topic}.",
    "My friend says {topic} is a waste of time. How can I respond politely?",
    "Rewrite this sentence to sound more formal: \"hey, can u send me the notes about {subject}?\"",
    "Translate into simple English: \"The phenomenon of {subject} has been studied extensively.\"",
    "Write a title and a one-sentence summary for a blog post about {topic}.",
]

# Format requests appended to some chat and code messages: more distinct messages, and the response
# lengths and styles (lists, one paragraph, short answers) that users ask for.
SUFFIXES = ["Keep it under 100 words.", "Use bullet points.", "Answer in one paragraph.", "Be brief.",
            "Explain it for a beginner.", "Use a friendly tone.", "Use a formal tone.", "Answer in two sentences.",
            "Give an example.", "Number the steps.", "End with a one-line summary.", "Avoid jargon.",
            "Write it as a short list."]

# ---------------------------------------------------------------- code
LANGS = ["Python", "JavaScript", "TypeScript", "Java", "C", "C++", "Go", "Rust", "Ruby", "PHP", "Kotlin",
         "Swift", "C#", "Lua", "Bash"]
CODE_TASKS = [
    "computes the factorial of n", "returns the sum of the digits of a number", "reverses a linked list",
    "finds the second largest number in an array", "counts the vowels in a string",
    "checks whether two strings are anagrams", "removes all whitespace from a string",
    "returns the greatest common divisor of two integers", "converts a binary string to an integer",
    "computes the average of a list of numbers", "finds the most frequent element in a list",
    "rotates an array by k positions", "checks whether a year is a leap year",
    "returns all even numbers from a list", "counts the lines in a text file",
    "converts kilometres to miles", "generates a random password of a given length",
    "splits a list into chunks of size n", "implements bubble sort", "implements insertion sort",
    "implements a queue with two stacks", "checks whether parentheses in a string are balanced",
    "returns the intersection of two lists", "computes the power set of a small set",
    "transposes a matrix", "multiplies two matrices", "finds the minimum value in a binary search tree",
    "computes the running total of a list", "converts a string to title case",
    "removes duplicate characters from a string", "checks whether a number is a perfect square",
    "returns the Collatz sequence starting from n", "computes the dot product of two vectors",
    "finds the longest word in a sentence", "counts the words in a sentence",
    "converts Roman numerals to integers", "converts an integer to Roman numerals",
    "returns the first n prime numbers", "computes the median of a list",
    "checks whether a list is sorted", "merges two dictionaries", "parses a date string in ISO format",
    "formats a number with thousands separators", "computes the Hamming distance of two strings",
    "implements a simple counter class", "reads a JSON file and prints its keys",
    "returns the n-th triangular number", "finds all pairs in a list that sum to a target",
    "computes the area of a triangle from its three sides", "shuffles a list in place",
]
CODE_CONCEPTS = [
    "closures", "decorators", "generators", "exceptions", "classes and objects", "inheritance",
    "interfaces", "pointers", "hash maps", "linked lists", "binary trees", "big-O notation",
    "unit tests", "immutability", "async/await", "threads", "lambda functions", "type hints",
    "virtual environments", "environment variables", "regular expressions", "dependency injection",
    "memoization", "dynamic programming", "garbage collection", "stack and heap memory", "JSON",
    "HTTP status codes", "git branches", "merge conflicts", "SQL joins", "database indexes",
    "caching", "string formatting", "slicing", "iterators", "enums", "pattern matching", "modules",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.", "Write a short {lang} program that {task2}.",
    "How would you write code in {lang} that {task}?", "Show a {lang} example of a function that {task}.",
    "Write a {lang} function that {task}, and add a comment explaining each step.",
    "Explain {concept} in {lang} with a short example.", "What are {concept}? Give a {lang} example.",
    "When should I use {concept} in {lang}?", "What is a common bug related to {concept}, and how do I avoid it?",
    "Write a unit test in {lang} for a function that {task}.",
    "Here is my plan: a {lang} function that {task}. What edge cases should I handle?",
    "Explain the time complexity of a function that {task}.",
]
SNIPPETS = [
    ("def add(a, b):\n    return a - b", "it should add the two numbers"),
    ("for i in range(10)\n    print(i)", "it gives a syntax error"),
    ("nums = [3, 1, 2]\nnums = nums.sort()\nprint(nums)", "it prints None"),
    ("def first(xs):\n    return xs[1]", "it should return the first element"),
    ("total = 0\nfor x in [1, 2, 3]:\n    total = x\nprint(total)", "it should print 6"),
    ("if x = 5:\n    print('five')", "it does not run"),
    ("name = input('Name: ')\nprint('Hello ' + nme)", "it raises a NameError"),
    ("def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([]))", "it crashes on an empty list"),
]
SNIPPET_TEMPLATES = [
    "Fix this Python code, {why}:\n\n{code}", "What is wrong with this code? {why}.\n\n{code}",
    "Explain what this Python code does:\n\n{code}", "Rewrite this Python code so that it works ({why}):\n\n{code}",
]

# ---------------------------------------------------------------- math and reasoning
NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sami", "Tara", "Yuki"]
ITEMS = ["pencils", "apples", "books", "stickers", "marbles", "cookies", "cards", "stamps", "shells", "coins"]


def _math(r: random.Random) -> str:
    a, b, c = r.randint(2, 99), r.randint(2, 60), r.randint(2, 12)
    n1, n2, it = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    kinds = [
        lambda: f"What is {a} plus {b} times {c}?",
        lambda: f"What is {a * c} divided by {c}?",
        lambda: f"What is {r.choice([5, 10, 12, 20, 25, 30, 40, 75])}% of {a * 4}?",
        lambda: f"Solve for x: {c}x - {b} = {c * a - b}.",
        lambda: f"Solve for x: {c}x + {b} = {c * a + b}. Show your steps.",
        lambda: f"{n1} has {a} {it} and gives {min(a - 1, b)} to {n2}. How many {it} does {n1} have left?",
        lambda: f"{n1} buys {c} packs of {it} with {b} in each pack. How many {it} is that in total?",
        lambda: f"A car drives {a * c} km in {c} hours. What is its average speed?",
        lambda: f"What is the perimeter of a rectangle that is {a} cm long and {b} cm wide?",
        lambda: f"What is the area of a triangle with base {a} m and height {b} m?",
        lambda: f"A jacket costs ${a * 2} and is {r.choice([10, 15, 20, 30, 50])}% off. What is the new price?",
        lambda: f"What is the greatest common divisor of {a * c} and {b * c}?",
        lambda: f"Is {a * 2 + 1} a prime number? Explain your answer.",
        lambda: f"Convert {a * 15} minutes into hours and minutes.",
        lambda: f"What is {c} cubed?",
        lambda: f"What is the mean of {a}, {b}, {c} and {a + b}?",
        lambda: f"Write {a}/{a * c} as a fraction in lowest terms and as a decimal.",
        lambda: f"If {c} workers build a wall in {b} days, how long would {c * 2} workers take at the same rate?",
        lambda: f"A bag has {a} red and {b} blue balls. What is the probability of drawing a red ball?",
        lambda: f"{n1} saves ${c} every week. How many weeks until {n1} has ${c * a}?",
        lambda: f"What is {a} squared minus {b} squared?",
        lambda: f"Round {a}.{r.randint(100, 999)} to one decimal place.",
        lambda: f"How many seconds are there in {c} hours?",
        lambda: f"The ratio of cats to dogs at a shelter is {c}:{c + 1}. If there are {c * (2 * c + 1)} animals, how many are dogs?",
        lambda: f"What is the next number in the sequence {c}, {2 * c}, {3 * c}, {4 * c}, ...?",
        lambda: f"A recipe uses {c} cups of flour for {b} muffins. How much flour is needed for {b * 3} muffins?",
    ]
    return r.choice(kinds)()


REASONING = [
    "If all {a} are {b} and some {b} are {c}, must some {a} be {c}? Explain.",
    "Which is heavier, a kilogram of {x} or a kilogram of {y}? Explain your reasoning.",
    "{n1} is taller than {n2}, and {n2} is taller than {n3}. Who is the shortest?",
    "{n1} is older than {n2} but younger than {n3}. Who is the oldest?",
    "I have {k} {it}. I lose half of them and then find {j} more. How many do I have now?",
    "What comes next in the pattern: {x}, {y}, {x}, {y}, ...? Explain why.",
    "A farmer has {k} sheep. All but {j} run away. How many are left?",
    "If today is {day}, what day of the week will it be in {k} days?",
    "Explain, step by step, how you would decide whether to bring an umbrella when {sky}.",
    "Is the statement \"every {b} is a {a}\" true? Give an example or a counterexample.",
]
WORDS = ["cats", "animals", "pets", "birds", "squares", "rectangles", "shapes", "roses", "flowers", "plants",
         "apples", "fruits", "teachers", "people", "cars", "vehicles", "violins", "instruments"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SKIES = ["the sky is grey", "the forecast says 40% rain", "it rained yesterday", "there are dark clouds in the west"]


def _reasoning(r: random.Random) -> str:
    a, b, c = r.sample(WORDS, 3)
    x, y = r.sample(["feathers", "iron", "cotton", "stones", "red", "blue", "circle", "square"], 2)
    n1, n2, n3 = r.sample(NAMES, 3)
    return r.choice(REASONING).format(a=a, b=b, c=c, x=x, y=y, n1=n1, n2=n2, n3=n3, k=r.randint(5, 40),
                                      j=r.randint(1, 4), it=r.choice(ITEMS), day=r.choice(DAYS), sky=r.choice(SKIES))


def _chat(r: random.Random) -> str:
    s1, s2 = r.sample(CHAT_SUBJECTS, 2)
    text = r.choice(CHAT_TEMPLATES).format(topic=r.choice(CHAT_TOPICS), subject=s1, subject2=s2, k=r.randint(3, 7))
    return text + " " + r.choice(SUFFIXES) if r.random() < 0.4 else text


def _code(r: random.Random) -> str:
    if r.random() < 0.12:
        code, why = r.choice(SNIPPETS)
        return r.choice(SNIPPET_TEMPLATES).format(code=code, why=why)
    lang = r.choice(LANGS[:4] if r.random() < 0.5 else LANGS)  # mostly the common languages
    text = r.choice(CODE_TEMPLATES).format(lang=lang, task=r.choice(CODE_TASKS), task2=r.choice(CODE_TASKS),
                                           concept=r.choice(CODE_CONCEPTS))
    return text + " " + r.choice(SUFFIXES[:4] + SUFFIXES[8:10]) if r.random() < 0.3 else text


KINDS = [("chat", _chat, 0.36), ("code", _code, 0.32), ("math", _math, 0.22), ("reasoning", _reasoning, 0.10)]

# ---------------------------------------------------------------- version 2: more kinds of request
# Version 1 (above) made the shipped drafter's pool. Its templates x topics run out of distinct chat and
# code messages (at 200k prompts half are math) and leave out whole kinds that users ask for: emails and
# notes, names, how-to questions, differences, SQL, shell and git. Version 2 adds them; the numbers and
# topics are drawn, and none equals a held-out prompt (build() checks).
PEOPLE = ["my neighbour", "my manager", "a colleague", "my landlord", "my teacher", "a client", "my best friend",
          "my team", "my grandmother", "a new classmate", "the school principal", "my coach"]
EVENTS = ["a team lunch on Friday", "a project meeting next week", "a book club evening", "a charity run",
          "a birthday dinner", "a study group on Sunday", "a welcome party for new staff", "a picnic in the park",
          "a board game night", "a small farewell party", "a neighbourhood clean-up day", "a quiz night"]
FAVOURS = ["help them move house", "work late on Friday", "lend them my car", "join a committee",
           "organise the office party", "look after their dog for a week", "give a talk at short notice"]
BUSINESSES = ["a small coffee shop", "a bicycle repair shop", "a dog grooming salon", "a plant nursery",
              "a second-hand bookshop", "a food truck selling tacos", "a yoga studio", "a tutoring service",
              "a cleaning company", "a podcast about science", "a family-run pizzeria", "a board game cafe"]
TRIPS = ["a weekend at the beach", "a week of skiing", "a business trip to a rainy city", "a three-day camping trip",
         "a long train journey", "a summer music festival", "a visit to my grandparents", "a city break in winter"]
STORIES = ["Cinderella", "The Three Little Pigs", "Goldilocks and the Three Bears", "The Tortoise and the Hare",
           "Jack and the Beanstalk", "Hansel and Gretel", "The Ugly Duckling", "Snow White", "Pinocchio"]
DECISIONS = ["buying a house", "changing jobs", "starting a small business", "going back to university",
             "moving abroad", "buying an electric car", "getting a gym membership", "renting a flat with friends"]
PAIRS = [("a virus", "a bacterium"), ("speed", "velocity"), ("a lake", "a sea"), ("baking soda", "baking powder"),
         ("a crocodile", "an alligator"), ("a fruit", "a vegetable"), ("a comet", "an asteroid"),
         ("empathy", "sympathy"), ("a loan", "a grant"), ("a frog", "a toad"), ("mass", "weight"),
         ("a hurricane", "a tornado"), ("a republic", "a monarchy"), ("an alloy", "a compound")]
PLACES = ["Paris", "Tokyo", "a small mountain village", "the seaside", "a national park", "New York", "Rome",
          "a farm", "Barcelona", "a lakeside cabin", "London", "a desert oasis"]
THINGS = ["a reusable water bottle", "noise-cancelling headphones", "a handmade wooden chair", "a solar-powered lamp",
          "a backpack for students", "a smart thermostat", "a folding bicycle", "a ceramic teapot"]
DISHES = ["vegetable soup", "pancakes", "tomato pasta", "guacamole", "banana bread", "fried rice",
          "fruit salad", "lentil curry", "an omelette", "hummus"]
HABITS = ["walking every day", "drinking enough water", "reading before bed", "meditating for ten minutes",
          "cooking at home", "keeping a gratitude journal", "stretching in the morning", "learning one new word a day"]
CHAT_TEMPLATES_2 = [
    "Write a short, polite email to {person} about {event}.", "Write a friendly message inviting {person} to {event}.",
    "How do I politely say no when {person} asks me to {favour}?", "Suggest {k} names for {business}.",
    "Give me a packing list for {trip}.", "Summarize the story of {story} in {k} sentences.",
    "What should I consider before {decision}?", "Explain the difference between {a} and {b}.",
    "Write a thank-you note to {person}.", "Describe a perfect day in {place}.",
    "What are {k} fun things to do in {place}?", "Write a short product description for {thing}.",
    "Give me a simple recipe for {dish}.", "What are the benefits of {habit}?",
    "Write a short apology to {person} for missing {event}.", "Why do people enjoy {topic}?",
    "Write a slogan for {business}.", "What is the best way to start {habit}?",
    "Tell me a short bedtime story set in {place}.", "Give me {k} questions to ask {person} at {event}.",
]
HOWTOS = ["read a text file line by line", "sort a list of numbers", "get the current date and time",
          "convert a string to a number", "check if a key exists in a dictionary", "make an HTTP request",
          "split a string by commas", "remove an item from a list", "write data to a JSON file",
          "measure how long a function takes", "join a list of strings", "generate a random number",
          "copy a file", "check whether a file exists", "loop over a dictionary", "round a number to two decimals"]
CODE_PAIRS = [("a class", "an object"), ("a function", "a method"), ("a set", "a list"), ("break", "continue"),
              ("a shallow copy", "a deep copy"), ("an array", "a linked list"), ("a process", "a thread"),
              ("compile time", "run time"), ("a stack", "a queue"), ("an interface", "an abstract class")]
SQL_TASKS = ["counts the customers in each city", "finds the products that cost more than 100",
             "returns the average salary per department", "lists the employees hired in 2020",
             "deletes the rows with an empty email", "joins the orders and customers tables on customer_id",
             "finds duplicate email addresses in a users table", "updates the price of the product with id 7",
             "returns the five best-selling products", "counts the orders placed each month"]
SHELL_TASKS = ["counts the lines in every .py file in a folder", "renames all .jpeg files to .jpg",
               "shows the ten largest files in a directory", "prints the lines of a log file that contain ERROR",
               "deletes files older than 30 days", "shows how much disk space is free",
               "lists the running processes that use the most memory", "downloads a file from a URL",
               "compresses a folder into a .tar.gz archive", "replaces a word in every .txt file"]
GIT_COMMANDS = ["git status", "git pull", "git log --oneline", "git stash", "git branch -d", "git rebase",
                "git diff", "git clone", "git reset --hard", "git checkout -b", "git merge", "git tag"]
CLASSES = [("Queue", "enqueue, dequeue and size"), ("BankAccount", "deposit, withdraw and balance"),
           ("Counter", "increment, decrement and reset"), ("Rectangle", "area, perimeter and scale"),
           ("TodoList", "add, remove and list_items"), ("Timer", "start, stop and elapsed"),
           ("Library", "add_book, borrow and return_book"), ("Temperature", "to_celsius and to_fahrenheit")]
CODE_TEMPLATES_2 = [
    "How do I {howto} in {lang}?", "What is the difference between {a} and {b} in {lang}?",
    "Write a SQL query that {sql}.", "Write a shell command that {shell}.", "What does the command '{git}' do?",
    "Write a {lang} class called {cls} with {methods} methods.", "Explain what '{git}' does and when to use it.",
    "Show me how to {howto} in {lang}, with a short explanation.",
]


def _chat_2(r: random.Random) -> str:
    if r.random() < 0.4:
        return _chat(r)
    a, b = r.choice(PAIRS)
    text = r.choice(CHAT_TEMPLATES_2).format(
        person=r.choice(PEOPLE), event=r.choice(EVENTS), favour=r.choice(FAVOURS), k=r.randint(3, 7),
        business=r.choice(BUSINESSES), trip=r.choice(TRIPS), story=r.choice(STORIES), decision=r.choice(DECISIONS),
        a=a, b=b, place=r.choice(PLACES), thing=r.choice(THINGS), dish=r.choice(DISHES), habit=r.choice(HABITS),
        topic=r.choice(CHAT_TOPICS))
    return text + " " + r.choice(SUFFIXES) if r.random() < 0.3 else text


def _code_2(r: random.Random) -> str:
    if r.random() < 0.5:
        return _code(r)
    a, b = r.choice(CODE_PAIRS)
    cls, methods = r.choice(CLASSES)
    text = r.choice(CODE_TEMPLATES_2).format(
        howto=r.choice(HOWTOS), lang=r.choice(LANGS[:4] if r.random() < 0.6 else LANGS), a=a, b=b,
        sql=r.choice(SQL_TASKS), shell=r.choice(SHELL_TASKS), git=r.choice(GIT_COMMANDS), cls=cls, methods=methods)
    return text + " " + r.choice(SUFFIXES[:4] + SUFFIXES[8:10]) if r.random() < 0.3 else text


def _math_2(r: random.Random) -> str:
    if r.random() < 0.6:
        return _math(r)
    a, b, c = r.randint(2, 60), r.randint(2, 60), r.randint(3, 12)
    g = r.randint(2, 9)
    price = r.choice(["1.50", "2.25", "3.75", "4.20", "0.80", "6.50"])
    kinds = [
        lambda: f"Simplify the fraction {a * g}/{b * g}.",
        lambda: f"What is the sum of the interior angles of a polygon with {c} sides?",
        lambda: f"If I buy {c} {r.choice(ITEMS)} at ${price} each and pay with a $50 bill, how much change do I get?",
        lambda: f"What is the square root of {a * a}, and why?",
        lambda: f"Convert {c}.{r.choice([25, 5, 75])} hours into hours and minutes.",
        lambda: f"What is the area of a circle with radius {c} cm? Use pi = 3.14.",
        lambda: f"A rectangle has a perimeter of {2 * (a + b)} cm and a width of {b} cm. What is its length?",
        lambda: f"What is {a}% of {b * 10}, rounded to one decimal place?",
        lambda: f"A shop sells {a} items on Monday and {b} more on Tuesday than on Monday. How many in total?",
        lambda: f"Order these numbers from smallest to largest: {a / 10}, {b}, {c / 4}, {a}.",
    ]
    return r.choice(kinds)()


KINDS_2 = [("chat", _chat_2, 0.38), ("code", _code_2, 0.32), ("math", _math_2, 0.20), ("reasoning", _reasoning, 0.10)]
PROMPT_VERSIONS = {1: KINDS, 2: KINDS_2}

# ---------------------------------------------------------------- requests the target writes itself
# Templates steer the target over kinds and topics; sampling its answer gives requests in wordings no
# template has (train.stage_ask keeps the clean, distinct ones).
ASKERS = ["a student", "a busy parent", "a retired teacher", "a software engineer", "a nurse", "a small-business owner",
          "a curious child", "a traveller", "a scientist", "a beginner programmer", "a cook", "a gardener",
          "a job seeker", "a history fan", "a data analyst", "a musician"]
ASK_TEMPLATES = [
    ("chat", "Write one question that {asker} might ask an AI assistant about {topic}. Write only the question."),
    ("chat", "Write a short request that {asker} might send to a chatbot about {subject}. Write only the request."),
    ("chat", "Write one thing {asker} might ask a helpful assistant to write for them. Write only the request."),
    ("chat", "Think of a question about {subject} that has a clear answer. Write only the question."),
    ("code", "Write a short programming task in {lang} that {asker} might ask for help with. Write only the task."),
    ("code", "Write a question a beginner might ask about {concept} in {lang}. Write only the question."),
    ("math", "Write a short math word problem about {item} for a {grade} student. Write only the problem."),
    ("math", "Write a simple arithmetic or algebra question. Write only the question."),
    ("reasoning", "Write a short logic puzzle or riddle. Write only the puzzle."),
]
GRADES = ["first-grade", "third-grade", "fifth-grade", "middle-school", "high-school"]


def ask_instructions(n: int, seed: int = 0) -> list[dict]:
    """-> n rows {"kind", "instruction"}: the user messages that ask the target to write a request."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        kind, t = r.choice(ASK_TEMPLATES)
        out.append({"kind": kind, "instruction": t.format(
            asker=r.choice(ASKERS), topic=r.choice(CHAT_TOPICS), subject=r.choice(CHAT_SUBJECTS),
            lang=r.choice(LANGS), concept=r.choice(CODE_CONCEPTS), item=r.choice(ITEMS), grade=r.choice(GRADES))})
    return out


_LABEL = re.compile(r"^(question|request|task|problem|puzzle|riddle|prompt|asked|a)\s*\d*\s*:\s*", re.I)
_QUOTED = re.compile(r'["\u201c]([^"\u201d]+)["\u201d]?')


def clean_request(text: str, min_chars: int = 15, max_chars: int = 400) -> str | None:
    """The target's written request, tidied, or None when no single request of min_chars–max_chars is found.

    A small model often wraps the request ('A student might ask: "How do ...?"') or announces it and puts it
    in the next paragraph ('A musician might ask:'), so: the paragraph after a lead-in that ends with a colon,
    the quoted part when there is one, no "Question:" label."""
    paragraphs = [q.strip() for q in text.strip().split("\n\n") if q.strip()]
    if not paragraphs:
        return None
    text = paragraphs[1] if paragraphs[0].endswith(":") and len(paragraphs) > 1 else paragraphs[0]
    quoted = _QUOTED.search(text)
    if quoted and len(quoted.group(1).strip()) >= min_chars:
        text = quoted.group(1)
    text = _LABEL.sub("", text.strip()).strip().strip('"').strip()
    if text.endswith(":") or not (min_chars <= len(text) <= max_chars):
        return None
    return text


def normalise(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def heldout_messages() -> set[str]:
    """Normalised user messages of the evaluation sets (prompts/*.jsonl)."""
    out = set()
    from . import PROMPTS_DIR
    for f in sorted(PROMPTS_DIR.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out |= {normalise(m["content"]) for m in json.loads(line)["messages"] if m["role"] == "user"}
    return out


def build(n: int = 6000, seed: int = 0, version: int = 1) -> list[dict]:
    """-> n rows {"id", "kind", "messages"}: distinct single-turn chats, none equal to a held-out prompt.
    version: the template set (PROMPT_VERSIONS); 1 made the shipped drafter's pool."""
    if version not in PROMPT_VERSIONS:
        raise ValueError(f"prompt version {version} is not one of {sorted(PROMPT_VERSIONS)}")
    r = random.Random(seed)
    banned, seen, rows = heldout_messages(), set(), []
    names, fns, weights = zip(*PROMPT_VERSIONS[version])
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"only {len(rows)} distinct training prompts could be composed, asked for {n}")
        k = r.choices(range(len(fns)), weights)[0]
        text = fns[k](r)
        key = normalise(text)
        if key in seen or key in banned:
            continue
        seen.add(key)
        rows.append({"id": f"train-{len(rows):05d}", "kind": names[k], "messages": [{"role": "user", "content": text}]})
    return rows


__all__ = ["build", "heldout_messages", "normalise", "ask_instructions", "clean_request", "KINDS", "KINDS_2", "PROMPT_VERSIONS"]
